"""The command line: `moestream archs`, `moestream run` on a tiny checkpoint, and the module entry point."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moestream
from moestream import cli

REPO = Path(moestream.__file__).resolve().parent.parent
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_next", "qwen3_5_moe", "gpt_oss",
            "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gemma4"]


def _python_m(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "moestream", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=cwd or REPO, timeout=120)


@pytest.fixture(scope="module")
def expected_tokens(tiny_qwen3):
    """What the Python API generates greedily for the prompt the CLI tests use."""
    tokens = moestream.load(tiny_qwen3, device="cpu", dtype="float32").generate([3, 4, 5], max_tokens=4)
    assert len(tokens) == 4   # no end-of-sequence token among them, so the CLI must print all four
    return tokens


def _check_run_output(out: str, err: str, expected: list[int]) -> None:
    assert [int(t) for t in out.split()] == expected
    assert out.endswith("\n")
    summary = err.strip().splitlines()
    assert len(summary) == 1, err
    assert "TTFT" in summary[0] and "tok/s" in summary[0] and "prompt 3 tokens" in summary[0]
    assert "generated 4 tokens" in summary[0]


def test_archs_lists_every_family(capsys):
    assert cli.main(["archs"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    rows = [line.split()[0] for line in lines[2:] if not line.startswith(" ")]   # long cells wrap below their row
    assert sorted(rows) == sorted(FAMILIES), out
    assert err == ""


def test_run_prints_token_ids_without_a_tokenizer(tiny_qwen3, expected_tokens, capsys):
    rc = cli.main(["run", str(tiny_qwen3), "-p", "3 4 5", "--max-tokens", "4", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0
    _check_run_output(out, err, expected_tokens)


def test_run_reads_the_prompt_from_stdin(tiny_qwen3, expected_tokens, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("3 4 5\n"))
    rc = cli.main(["run", str(tiny_qwen3), "--max-tokens", "4", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0
    _check_run_output(out, err, expected_tokens)


@pytest.mark.parametrize("stdin", ["", "   \n"])
def test_run_with_an_empty_prompt_on_stdin(tiny_qwen3, capsys, monkeypatch, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert cli.main(["run", str(tiny_qwen3), "--max-tokens", "4", "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("moestream: error: ") and err.count("\n") == 1 and "empty" in err


def test_run_without_prompt_on_a_terminal(tiny_qwen3, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    assert cli.main(["run", str(tiny_qwen3), "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("moestream: error: no prompt") and err.count("\n") == 1


def test_run_sampling_options_are_passed_through(tiny_qwen3, capsys):
    argv = ["run", str(tiny_qwen3), "-p", "3 4 5", "--max-tokens", "6", "--device", "cpu",
            "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "11"]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == first
    engine = moestream.load(tiny_qwen3, device="cpu", dtype="float32")
    expected = engine.generate([3, 4, 5], max_tokens=6, temperature=0.9, top_k=20, top_p=0.95, seed=11)
    assert [int(t) for t in first.split()] == expected


def test_module_entry_point_runs_with_the_prompt_on_stdin(tiny_qwen3, expected_tokens, tmp_path):
    proc = _python_m("run", str(tiny_qwen3), "--max-tokens", "4", "--device", "cpu", stdin="3 4 5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    _check_run_output(proc.stdout, proc.stderr, expected_tokens)


def test_module_help(tmp_path):
    proc = _python_m("--help", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: moestream")
    for command in ("run", "archs"):
        assert command in proc.stdout
    assert proc.stderr == ""


def test_run_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--prompt", "--max-tokens", "--device", "--max-context", "--temperature", "--top-p", "--stop"):
        assert option in out
