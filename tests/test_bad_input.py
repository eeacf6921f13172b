"""Everything a user can get wrong gets one clear line: a MoestreamError from the API, exit 1 from the CLI."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moestream
from moestream import cli
from moestream.errors import CheckpointError, DeviceError, InputError, MoestreamError, UnsupportedArchError

REPO = Path(moestream.__file__).resolve().parent.parent
SUPPORTED = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
EXPERT = "model.layers.0.mlp.experts.3.up_proj.weight"


# ---- helpers ------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _run_argv(model, *extra: str, prompt: str = "3 4 5") -> list[str]:
    return ["run", str(model), "-p", prompt, "--max-tokens", "2", "--device", "cpu", *extra]


def expect_error(capsys, exc_type, fragments, api, argv) -> None:
    """The API raises exc_type (a MoestreamError) with a one-line message; the CLI prints it on one line, exit 1."""
    with pytest.raises(exc_type) as info:
        api()
    assert isinstance(info.value, MoestreamError)
    message = str(info.value)
    assert "\n" not in message and message.strip()
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"

    capsys.readouterr()
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 1
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("moestream: error: ")
    for fragment in fragments:
        assert fragment in err


def _load(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", **kw)


# ---- folders and configs ------------------------------------------------------------------

def test_missing_folder(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    expect_error(capsys, CheckpointError, [str(missing), "does not exist"],
                 lambda: _load(missing), _run_argv(missing))


def test_folder_without_config(tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    expect_error(capsys, CheckpointError, ["config.json"], lambda: _load(folder), _run_argv(folder))


def test_config_that_is_not_json(tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    (folder / "config.json").write_text("{not json")
    expect_error(capsys, CheckpointError, ["config.json", "not valid JSON"], lambda: _load(folder), _run_argv(folder))


def test_unsupported_model_type_lists_the_supported_ones(tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    _edit_config(folder, model_type="llama")
    expect_error(capsys, UnsupportedArchError, ["'llama'", *SUPPORTED], lambda: _load(folder), _run_argv(folder))


def test_model_type_that_is_not_a_string(tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    _edit_config(folder, model_type=["qwen3_moe"])
    expect_error(capsys, UnsupportedArchError, ["model_type ['qwen3_moe']", "a list", "string"],
                 lambda: _load(folder), _run_argv(folder))


def test_a_checkpoint_folder_that_may_not_be_read(tiny_qwen3, tmp_path, capsys, monkeypatch):
    # the tests run as root, whom mode 000 does not stop: the permission check is what is mocked
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if str(path).startswith(str(folder))
                        else real(path, mode, **kw))
    expect_error(capsys, CheckpointError, [str(folder), "permission denied"], lambda: _load(folder), _run_argv(folder))


def test_a_permission_error_anywhere_is_one_line(tiny_qwen3, tmp_path, capsys, monkeypatch):
    from moestream.checkpoint import safetensors_index

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(safetensors_index, "read_safetensors_header", denied)
    assert cli.main(_run_argv(tiny_qwen3)) == 1
    out, err = capsys.readouterr()
    assert err.startswith("moestream: error: cannot read ") and "model.safetensors" in err and err.count("\n") == 1, err


def test_a_damaged_gguf_file_is_named(tmp_path, capsys):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    expect_error(capsys, CheckpointError, [str(gguf), "is not a readable GGUF file", "re-download"],
                 lambda: _load(gguf), _run_argv(gguf))


# ---- tensors ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [EXPERT, "model.layers.2.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_tensor_missing_from_the_shards_is_named(name, tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    expect_error(capsys, CheckpointError, [repr(name), "missing"], lambda: _load(folder), _run_argv(folder))


@pytest.mark.parametrize("key, value, tensor", [
    ("moe_intermediate_size", 24, "model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("hidden_size", 64, "model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("intermediate_size", 40, "model.layers.1.mlp.gate_proj.weight"),   # layer 1 is dense in the tiny qwen3
    ("vocab_size", 200, "model.embed_tokens.weight"),
])
def test_tensor_shape_disagreeing_with_the_config(key, value, tensor, tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    _edit_config(folder, **{key: value})
    expect_error(capsys, CheckpointError, [repr(tensor), "shape", "config.json"], lambda: _load(folder), _run_argv(folder))


@pytest.mark.parametrize("keep", ["0", "4", "100", "half", "all_but_one"])
def test_truncated_safetensors_file(keep, tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = {"half": len(data) // 2, "all_but_one": len(data) - 1}.get(keep) or int(keep)
    path.write_bytes(data[:n])
    expect_error(capsys, CheckpointError, [str(path)], lambda: _load(folder), _run_argv(folder))


def _header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("kind", ["garbage_start", "garbage_header", "header_not_an_object", "bad_dtype", "bad_offsets"])
def test_corrupt_safetensors_header(kind, tiny_qwen3, tmp_path, capsys):
    folder = _copy(tiny_qwen3, tmp_path / "ckpt")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = _header_length(path)
    if kind == "garbage_start":      # the length field itself is garbage
        data[:64] = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    elif kind == "garbage_header":   # a plausible length, garbage where the JSON should be
        data[8:8 + n] = bytes([0xFF, 0x00, 0x7B, 0x22]) * (n // 4) + b"\xfe" * (n % 4)
    else:
        header = json.loads(data[8:8 + n])
        first = next(k for k in header if k != "__metadata__")
        if kind == "header_not_an_object":
            header = list(header)
        elif kind == "bad_dtype":
            header[first]["dtype"] = "F42"
        else:
            header[first]["data_offsets"] = [str(x) for x in header[first]["data_offsets"]]
        raw = json.dumps(header).encode()
        raw += b" " * max(0, n - len(raw))   # keep the data where it was when the new header is not longer
        data = bytearray(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    path.write_bytes(bytes(data))
    expect_error(capsys, CheckpointError, [str(path)], lambda: _load(folder), _run_argv(folder))


# ---- shards -------------------------------------------------------------------------------

def _write_shards(src: Path, dst: Path, n: int = 3) -> list[str]:
    """The single-file checkpoint split into n shards plus model.safetensors.index.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, fname in enumerate(files):
        part = {k: tensors[k] for k in names[i::n]}   # interleaved, so every layer spans several shards
        save_file(part, dst / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return files


def test_multi_shard_checkpoint_gives_the_same_logits(tiny_qwen3, tmp_path):
    folder = tmp_path / "sharded"
    files = _write_shards(tiny_qwen3, folder)
    assert not (folder / "model.safetensors").exists() and all((folder / f).is_file() for f in files)
    single, sharded = _load(tiny_qwen3), _load(folder)
    assert {info.path.name for info in sharded.bank.store.index.tensors.values()} == set(files)
    ids = torch.randint(2, 160, (2, 19), generator=torch.Generator().manual_seed(4))
    assert torch.equal(single.logits(ids), sharded.logits(ids))
    prompt = ids[0, :7].tolist()
    assert sharded.generate(prompt, max_tokens=6, ignore_eos=True) == single.generate(prompt, max_tokens=6, ignore_eos=True)


def test_index_naming_a_missing_shard(tiny_qwen3, tmp_path, capsys):
    folder = tmp_path / "sharded"
    files = _write_shards(tiny_qwen3, folder)
    (folder / files[1]).unlink()
    expect_error(capsys, CheckpointError, [files[1], "missing"], lambda: _load(folder), _run_argv(folder))


def test_index_naming_one_shard_under_two_spellings(tiny_qwen3, tmp_path, capsys):
    folder = tmp_path / "sharded"
    files = _write_shards(tiny_qwen3, folder)
    (folder / "sub").mkdir()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    other = f"sub/../{files[0]}"
    first = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][first] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(capsys, CheckpointError, [repr(files[0]), repr(other)], lambda: _load(folder), _run_argv(folder))


@pytest.mark.parametrize("content", ["{not json", '{"metadata": {}}', "[1, 2]"])
def test_broken_index_file(content, tiny_qwen3, tmp_path, capsys):
    folder = tmp_path / "sharded"
    _write_shards(tiny_qwen3, folder)
    (folder / "model.safetensors.index.json").write_text(content)
    expect_error(capsys, CheckpointError, ["model.safetensors.index.json"], lambda: _load(folder), _run_argv(folder))


# ---- prompts, tokenizer, device -----------------------------------------------------------

def test_prompt_longer_than_the_models_context(tiny_qwen3, capsys):
    engine = _load(tiny_qwen3)
    assert engine.max_context == 256   # max_position_embeddings of the tiny configs
    prompt = [5] * 300
    expect_error(capsys, InputError, ["300", "256"], lambda: engine.generate(prompt, max_tokens=2),
                 _run_argv(tiny_qwen3, prompt=" ".join(map(str, prompt))))
    with pytest.raises(InputError, match="256"):
        engine.logits(torch.tensor([prompt]))


def test_prompt_longer_than_max_context(tiny_qwen3, capsys):
    prompt = [5] * 20
    expect_error(capsys, InputError, ["20", "16", "--max-context"],
                 lambda: _load(tiny_qwen3, max_context=16).generate(prompt, max_tokens=2),
                 _run_argv(tiny_qwen3, "--max-context", "16", prompt=" ".join(map(str, prompt))))


def test_generation_stops_when_the_context_is_full(tiny_qwen3):
    engine = _load(tiny_qwen3, max_context=16)
    assert len(engine.generate([5] * 14, max_tokens=10, ignore_eos=True)) == 2


def test_token_id_outside_the_vocabulary(tiny_qwen3, capsys):
    expect_error(capsys, InputError, ["160", "vocabulary"], lambda: _load(tiny_qwen3).generate([3, 160], max_tokens=2),
                 _run_argv(tiny_qwen3, prompt="3 160"))


def test_text_prompt_without_a_tokenizer(tiny_qwen3, capsys):
    engine = _load(tiny_qwen3)
    assert engine.tokenizer is None
    expect_error(capsys, InputError, ["tokenizer"], lambda: engine.generate("hello world", max_tokens=2),
                 _run_argv(tiny_qwen3, prompt="hello world"))
    with pytest.raises(InputError, match="tokenizer"):
        next(engine.stream("hello world"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cuda_device_without_a_gpu(tiny_qwen3, capsys):
    expect_error(capsys, DeviceError, ["cuda", "--device cpu"],
                 lambda: moestream.load(tiny_qwen3, device="cuda"),
                 _run_argv(tiny_qwen3)[:-2] + ["--device", "cuda"])


def test_unknown_dtype(tiny_qwen3, capsys):
    expect_error(capsys, InputError, ["'float8'"], lambda: moestream.load(tiny_qwen3, device="cpu", dtype="float8"),
                 _run_argv(tiny_qwen3, "--dtype", "float8"))


def test_cli_error_through_the_module_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "moestream", "run", str(tmp_path / "nope"), "-p", "1 2", "--device", "cpu"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream: error: ") and "does not exist" in lines[0]
