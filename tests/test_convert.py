"""`moestream convert` and packed checkpoints: same tokens as quantize-on-load, deterministic, resumable, checked."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import moestream
from moestream.cli import main as cli_main
from moestream.engine.convert import Converter, convert
from moestream.errors import CheckpointError, InputError
from moestream.quant.recipe import QuantRecipe
from tiny_models import QUANT_ARCHS

PROMPT = torch.randint(2, 160, (13,), generator=torch.Generator().manual_seed(4)).tolist()
RECIPE = QuantRecipe(experts="int4", attention="int8", layer_formats={-1: "int8"})


def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tokens(folder, **kw):
    return moestream.load(folder, device="cpu", dtype="float32", **kw).generate(PROMPT, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def packed(tiny_quant, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "q3"
    convert(tiny_quant, out, RECIPE, progress=False, device="cpu")
    return out


@pytest.mark.parametrize("arch", QUANT_ARCHS)
def test_convert_then_run_equals_quantize_on_load(tiny_quant_checkpoints, tmp_path, arch):
    source = tiny_quant_checkpoints[arch][0]
    out = tmp_path / "packed"
    convert(source, out, RECIPE, progress=False, device="cpu")
    on_load = _tokens(source, experts="int4", attention="int8", layer_formats={-1: "int8"})
    assert _tokens(out) == on_load
    assert _tokens(out, capacity=3) == on_load   # fetch from packed records stays exact


def test_packed_layout_records_and_bytes(packed, tiny_quant):
    layout = json.loads((packed / "layout.json").read_text())
    assert layout["format"] == "moestream-packed" and sorted(layout["layers"]) == ["0", "2"]
    first, last = layout["layers"]["0"], layout["layers"]["2"]
    assert first["format"] == "int4-g64" and last["format"] == "int8-g64"
    assert first["stride"] % 4096 == 0 and len(first["checksums"]) == 8
    assert (packed / first["file"]).stat().st_size == 8 * first["stride"]
    for name in ("config.json", "model.safetensors"):
        assert (packed / name).is_file()
    engine = moestream.load(packed, device="cpu", dtype="float32", capacity=3)
    assert engine.plan.kind == "packed" and engine.bank.formats[0].name == "int4-g64"


def test_converting_twice_is_byte_identical(packed, tiny_quant, tmp_path):
    again = tmp_path / "again"
    convert(tiny_quant, again, RECIPE, progress=False, device="cpu")
    assert _digest(again) == _digest(packed)


def test_an_interrupted_convert_resumes(packed, tiny_quant, tmp_path, monkeypatch):
    out = tmp_path / "q3"
    real = Converter._write_layer
    calls = []

    def dying(self, layer, bar):
        calls.append(layer)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, layer, bar)

    monkeypatch.setattr(Converter, "_write_layer", dying)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_quant, out, RECIPE, progress=False, device="cpu")
    assert not out.exists() and (tmp_path / ".q3.partial" / "progress.json").is_file()
    monkeypatch.setattr(Converter, "_write_layer", real)
    result = convert(tiny_quant, out, RECIPE, progress=False, device="cpu")
    assert result.resumed_layers == 1 and _digest(out) == _digest(packed)
    assert not (tmp_path / ".q3.partial").exists()
    other = convert(tiny_quant, tmp_path / "other", QuantRecipe(experts="nf4"), progress=False, device="cpu")
    assert other.resumed_layers == 0


def test_a_full_disk_leaves_nothing_under_the_final_name(tiny_quant, tmp_path, monkeypatch):
    import errno

    def full(self, layer, bar):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Converter, "_write_layer", full)
    with pytest.raises(InputError, match="disk filled up"):
        convert(tiny_quant, tmp_path / "q3", RECIPE, progress=False, device="cpu")
    assert not (tmp_path / "q3").exists()


@pytest.mark.parametrize("args,match", [
    (["--experts", "int5"], "unknown"),
    (["--experts", "int4-g16"], "group size 16"),
    ([], "needs --experts"),
    (["--experts", "bf16"], "stores quantized experts"),
    (["--experts", "int4", "--layer-format", "x=int8"], "LAYER=FORMAT"),
])
def test_convert_bad_arguments_are_one_line(tiny_quant, tmp_path, capsys, args, match):
    assert cli_main(["convert", str(tiny_quant), str(tmp_path / "o"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("moestream: error:") and err.count("\n") == 1 and match in err


def test_convert_refuses_packed_sources_existing_outputs_and_missing_folders(packed, tiny_quant, tmp_path):
    with pytest.raises(InputError, match="already a packed"):
        convert(packed, tmp_path / "x", RECIPE, progress=False)
    with pytest.raises(InputError, match="--force"):
        convert(tiny_quant, packed, RECIPE, progress=False)
    with pytest.raises(InputError, match="does not exist"):
        convert(tiny_quant, tmp_path / "missing" / "x", RECIPE, progress=False)
    forced = tmp_path / "forced"
    forced.mkdir()
    (forced / "stale").write_text("x")
    convert(tiny_quant, forced, RECIPE, progress=False, device="cpu", force=True)
    assert not (forced / "stale").exists() and (forced / "layout.json").is_file()


def test_a_damaged_packed_checkpoint_names_the_layer_and_expert(packed, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    layer_file = bad / "experts" / "layer-002.bin"
    data = bytearray(layer_file.read_bytes())
    stride = json.loads((bad / "layout.json").read_text())["layers"]["2"]["stride"]
    data[5 * stride + 7] ^= 0xFF                       # expert 5 of layer 2
    layer_file.write_bytes(bytes(data))
    engine = moestream.load(bad, device="cpu", dtype="float32", capacity=2, discovery=False)
    with pytest.raises(CheckpointError, match="expert 5 of layer 2"):
        for _ in range(20):   # until routing reaches expert 5
            engine.generate(torch.randint(2, 160, (40,)).tolist(), max_tokens=4, ignore_eos=True)
    layer_file.write_bytes(bytes(data[:3 * stride + 100]))
    with pytest.raises(CheckpointError, match="layer 2.*truncated from expert 3"):
        moestream.load(bad, device="cpu", dtype="float32")
    (bad / "layout.json").write_text("{")
    with pytest.raises(CheckpointError, match="layout.json"):
        moestream.load(bad, device="cpu", dtype="float32")


def test_a_packed_checkpoint_keeps_its_precision(packed):
    with pytest.raises(InputError, match="precision is fixed"):
        moestream.load(packed, device="cpu", dtype="float32", experts="int8")


def test_the_cli_says_how_to_resume_and_that_it_resumed(tiny_quant, tmp_path, monkeypatch, capsys):
    real, calls = Converter._write_layer, []

    def dying(self, layer, bar):
        calls.append(layer)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, layer, bar)

    argv = ["convert", str(tiny_quant), str(tmp_path / "q3"), "--experts", "int4", "--device", "cpu"]
    monkeypatch.setattr(Converter, "_write_layer", dying)
    assert cli_main(argv) == 130
    err = capsys.readouterr().err
    assert err.startswith("moestream: interrupted; run the same command again to resume") and err.count("\n") == 1, err
    monkeypatch.setattr(Converter, "_write_layer", real)
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "resuming an interrupted conversion: 2 of " in err, err   # the dense file and one layer
    # a small model's rate in a unit that shows it, never "0.00 GB/s"
    assert re.search(r" [1-9][0-9.]* [kMG]?B/s of expert weights; resumed, keeping 2 of [0-9]+ parts", err), err

