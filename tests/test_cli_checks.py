"""What the command line checks before it spends anything (no torch import, no weight read), and
what it tells a new user: help with defaults, --version, a table that fits a terminal, the routing
of a benchmark, the CPU's threads, Ctrl-C on its own line, a resumable convert, a right-sized
prefix cache."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moestream
from moestream.cli import DEMO_MODEL, build_parser, main as cli_main

REPO = Path(moestream.__file__).resolve().parent.parent

PROBE = ("import sys\n"
         "from moestream.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n"
         "sys.exit(rc)\n")


def _fails_before_torch(*argv: str, cwd: Path, match: str) -> None:
    """The command exits 1 with one `moestream: error:` line holding `match`, without importing torch."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("moestream: error:") and proc.stderr.count("\n") == 1, proc.stderr
    assert match in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "torch not imported", (argv, proc.stdout)


@pytest.fixture(scope="module")
def demo_without_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo") / "demo"
    shutil.copytree(DEMO_MODEL, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


# ---- errors that need no model come first ----------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["run", "no/such/model/here", "-p", "hi"], "model folder no/such/model/here does not exist"),
    (["run", "-p", "hi", "--gpu-memory", "lots"], "--gpu-memory 'lots' is not a memory size"),
    (["bench", "--host-memory", "12XB"], "--host-memory '12XB'"),
    (["run", "-p", ""], "the prompt is empty"),
    (["perplexity", "--file", "missing.py"], "--file missing.py does not exist"),
    (["profile", "--prompts", "missing.txt", "--out", "p.json"], "--prompts missing.txt does not exist"),
    (["convert", "src", "out", "--experts", "int4"], "model folder src does not exist"),
    (["serve", "--prefix-cache-memory", "some"], "--prefix-cache-memory 'some'"),
])
def test_errors_that_need_no_model_come_before_torch(tmp_path, argv, match):
    _fails_before_torch(*argv, cwd=tmp_path, match=match)


def test_convert_without_experts_is_refused_before_torch(tmp_path):
    """A full-precision source needs --experts (only an FP8 one converts without it), told from
    config.json alone."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "torch_dtype": "bfloat16"}))
    _fails_before_torch("convert", "src", "out", cwd=tmp_path, match="convert needs --experts FORMAT")


def test_a_damaged_gguf_model_is_named_before_torch(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(28))
    _fails_before_torch("run", "m.gguf", "-p", "hi", cwd=tmp_path, match="m.gguf is not a readable GGUF file")


def test_chat_without_a_template_is_refused_before_the_load(demo_without_template, tmp_path):
    _fails_before_torch("run", str(demo_without_template), "--chat", "-p", "hi", cwd=tmp_path,
                        match="has no chat template")


def test_token_ids_that_are_not_ascii_digits_are_named_before_the_load(tiny_qwen3, tmp_path):
    _fails_before_torch("run", str(tiny_qwen3), "-p", "3 ²³", cwd=tmp_path, match="'²³', which is not a token id")


def test_a_port_in_use_is_one_line_before_the_load(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _fails_before_torch("serve", "--port", str(port), cwd=tmp_path, match=f"port {port} on 127.0.0.1 is in use")


# ---- help, version, tables -------------------------------------------------------------------

def _flags(command: str) -> dict[str, str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s: a.help or "" for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("command,flags", [
    ("run", ["--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--cpu-threads"]),
    ("serve", ["--port", "--max-batch", "--max-queue", "--prefix-cache-memory"]),
    ("bench", ["--prompt-tokens", "--gen-tokens", "--seed", "--temperature"]),
    ("check", ["--device", "--dtype", "--max-context"]),
])
def test_help_states_the_defaults(command, flags):
    helps = _flags(command)
    for flag in flags:
        assert "default" in helps[flag], f"{command} {flag}: {helps[flag]!r}"


def test_help_says_what_cpu_threads_sizes():
    text = _flags("run")["--cpu-threads"]
    assert "torch" in text and "every core" in text


def test_hybrid_help_does_not_claim_a_gpu_is_needed():
    text = _flags("run")["--miss-policy"]
    assert "needs a GPU" not in text and "on the CPU" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moestream {moestream.__version__}"


def test_archs_fits_a_hundred_columns(capsys):
    from moestream.cli.archs import table

    assert cli_main(["archs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    wide = [{"a": "x", "b": "word " * 40}, {"a": "yy", "b": "short"}]
    assert max(len(line) for line in table(wide, width=30).splitlines()) <= 30
    assert table(wide, width=30).splitlines()[2].startswith("x ")


# ---- plans and benchmarks --------------------------------------------------------------------

def test_a_cpu_plan_has_no_cuda_slack(tiny_qwen3, capsys):
    from moestream.engine import EngineConfig, RuntimeConfig
    from moestream.engine.plan import SLACK_BYTES, plan_load, plan_memory
    from moestream.sizes import format_bytes

    plan = plan_load(EngineConfig(str(tiny_qwen3), RuntimeConfig(device="cpu", dtype="float32")))
    assert plan.memory.slack_bytes == 0
    on_cuda, on_cpu = (plan_memory(plan.config, torch.float32, max_context=64, **kw) for kw in ({}, {"slack_bytes": 0}))
    assert on_cuda.fixed_bytes - on_cpu.fixed_bytes == SLACK_BYTES
    assert cli_main(["check", str(tiny_qwen3), "--device", "cpu", "--dtype", "float32"]) == 0
    workspace = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("workspace"))
    assert workspace.split(None, 1)[1] == format_bytes(plan.memory.workspace_bytes)


def test_the_prefill_chunk_reaches_the_plan_and_the_engine(tiny_qwen3, capsys):
    """--prefill-chunk sizes the plan's activations (check) and the prompt's forwards (run)."""
    from moestream.engine import EngineConfig, RuntimeConfig
    from moestream.engine.plan import plan_load
    from moestream.sizes import format_bytes

    def workspace(*flags):
        assert cli_main(["check", str(tiny_qwen3), "--device", "cpu", "--dtype", "float32", *flags]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("workspace")).split(None, 1)[1]

    plan = plan_load(EngineConfig(str(tiny_qwen3), RuntimeConfig(device="cpu", dtype="float32", prefill_chunk=2048)))
    assert workspace("--prefill-chunk", "2048") == format_bytes(plan.memory.workspace_bytes) != workspace()
    from moestream.cli.common import engine_config, load_engine
    from moestream.cli.main import build_parser

    args = build_parser().parse_args(["run", str(tiny_qwen3), "--device", "cpu", "--prefill-chunk", "4", "-p", "x"])
    assert engine_config(args).runtime.prefill_chunk == 4
    engine, _ = load_engine(args)
    engine.generate(list(range(5, 14)), max_tokens=2, ignore_eos=True)
    assert engine.counters.prefill_chunks == 3   # 9 prompt tokens, 4 a forward


def test_a_capacity_above_the_expert_count_says_at_most(tiny_qwen3, capsys):
    assert cli_main(["check", str(tiny_qwen3), "--device", "cpu", "--capacity", "1000"]) == 1
    err = capsys.readouterr().err
    assert "at most 8" in err and "hybrid" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("routing,says", [([], "the model's router"),
                                          (["--routing", "uniform"], "uniform (synthetic): experts chosen by the benchmark")])
def test_bench_table_names_its_routing(tiny_qwen3, capsys, routing, says):
    argv = ["bench", str(tiny_qwen3), "--device", "cpu", "--prompt-tokens", "8", "--gen-tokens", "3", *routing]
    assert cli_main(argv) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("routing "))
    assert line.split(None, 1)[1].startswith(says), line


# ---- threads, Ctrl-C, progress ----------------------------------------------------------------

THREADS = ("import json, sys, torch\n"
           "from moestream.cli import main\n"
           "for argv in json.loads(sys.argv[1]):\n"
           "    torch.set_num_threads(7)\n"
           "    sys.argv = ['moestream', *argv]\n"
           "    assert main() == 0\n"
           "    print('threads', torch.get_num_threads())\n")


def _threads_after_runs(folder, *extras: list[str]) -> list[int]:
    """torch's threads after each `moestream run` (with each of `extras`) as the process's own command
    (7 before each), run one after the other in one process: each a torch import less."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    runs = [["run", str(folder), "-p", "3 4", "--max-tokens", "1", "--device", "cpu", *extra] for extra in extras]
    proc = subprocess.run([sys.executable, "-c", THREADS, json.dumps(runs)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("threads ")]


def test_cpu_threads_sets_torchs_threads(tiny_qwen3):
    from moestream.kernels import cpu_moe

    default = max(1, len(cpu_moe.usable_cpus()) - 1)   # every core but one
    assert _threads_after_runs(tiny_qwen3, ["--cpu-threads", "3"], []) == [3, default]


def test_omp_num_threads_where_set_sizes_torchs_threads(monkeypatch):
    import argparse

    from moestream.cli.common import set_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(before + 1)
        set_threads(argparse.Namespace(cpu_threads=None, own_process=True))
        assert torch.get_num_threads() == before + 1   # left to the user's setting
        set_threads(argparse.Namespace(cpu_threads=before + 2, own_process=False))
        assert torch.get_num_threads() == before + 1   # main() called from a program changes nothing
    finally:
        torch.set_num_threads(before)


def test_ctrl_c_while_generating_ends_the_line_first(tiny_qwen3, capsys, monkeypatch):
    from moestream.engine import Engine

    def interrupted(self, ids, **kw):
        yield 7
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "stream_tokens", interrupted)
    assert cli_main(["run", str(tiny_qwen3), "-p", "3 4", "--device", "cpu"]) == 130
    out, err = capsys.readouterr()
    assert out == "7 \n" and err == "moestream: interrupted\n"


def test_perplexity_reports_progress_per_window():
    from moestream.runtime.perplexity import sliding_window_scores

    ids = list(range(2, 40))
    seen = []
    scores = sliding_window_scores(lambda x: torch.randn(1, x.shape[1], 50, generator=torch.Generator().manual_seed(0)),
                                   ids, window=10, progress=seen.append)
    assert len(seen) > 3 and sum(seen) == scores.tokens == len(ids) - 1


# ---- the server's prefix cache ------------------------------------------------------------------

def test_the_default_prefix_cache_is_sized_from_the_model(tiny_qwen3):
    from moestream.engine import EngineConfig, RuntimeConfig
    from moestream.engine.plan import PREFIX_CACHE_MOST, default_prefix_cache_bytes, plan_load
    from moestream.model.decoder import cache_bytes

    cfg = EngineConfig(str(tiny_qwen3), RuntimeConfig(device="cpu", dtype="float32"))
    plan = plan_load(cfg)
    want = cache_bytes(plan.config, plan.spec, 8, plan.context, plan.dtype)
    assert 0 < default_prefix_cache_bytes(cfg, 8) == want < PREFIX_CACHE_MOST
    demo = EngineConfig(str(DEMO_MODEL), RuntimeConfig(device="cpu"))
    assert default_prefix_cache_bytes(demo, 8) < 64 * 2**20   # the 33 MB demo holds no 1 GiB cache
    assert default_prefix_cache_bytes(demo, 10**6) == PREFIX_CACHE_MOST
    assert build_parser().parse_args(["serve"]).prefix_cache_memory is None


def test_json_is_one_convention_in_run_bench_and_perplexity(tmp_path, capsys):
    """`--json FILE` writes the JSON to FILE in every command; `--json` alone prints it on stdout, alone
    (bench, perplexity) or after the generated text (run); run's older `--stats-json FILE` still works."""
    sample = tmp_path / "sample.py"
    sample.write_text("def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n" * 4)
    common = ["--device", "cpu"]
    for command, check in ((["bench", "--prompt-tokens", "8", "--gen-tokens", "4"], "decode_tok_s"),
                           (["perplexity", "--file", str(sample)], "perplexity"),
                           (["run", "-p", "def f(", "--max-tokens", "4"], "hits")):
        capsys.readouterr()
        assert cli_main([*command, *common, "--json", str(tmp_path / "out.json")]) == 0
        assert check in json.loads((tmp_path / "out.json").read_text())
        capsys.readouterr()
        assert cli_main([*command, *common, "--json"]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert check in json.loads(out[-1]), command                      # the last line is the JSON
        if command[0] != "run":
            assert len(out) == 1, out                                  # and nothing else
    assert cli_main(["run", "-p", "def f(", "--max-tokens", "2", *common, "--stats-json", str(tmp_path / "s.json")]) == 0
    stats = json.loads((tmp_path / "s.json").read_text())
    assert "hits" in stats
    # run's own figures beside the bank's: the load, the first token, what it generated
    assert stats["run"]["load_s"] > 0 and stats["run"]["ttft_s"] > 0 and stats["run"]["generated_tokens"] == 2
    assert stats["run"]["prompt_tokens"] > 0 and stats["run"]["device"] == "cpu"
