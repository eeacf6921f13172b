"""The command line against hostile input: numeric flags, text that is not UTF-8, damaged tokenizers,
output paths, save failures and Ctrl-C. Every failure is one line and a non-zero exit."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moestream
from moestream.cli import DEMO_MODEL, main as cli_main

REPO = Path(moestream.__file__).resolve().parent.parent


def _one_line_error(capsys, match: str) -> None:
    out, err = capsys.readouterr()
    assert err.startswith("moestream: error:") and err.count("\n") == 1 and match in err, err
    assert "Traceback" not in err


def _exit_code(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as exc:   # argparse's errors leave through SystemExit
        return exc.code


# every numeric flag of every command, with a value it must refuse
NUMERIC = [
    ("run", "--max-tokens", "0"), ("run", "--max-tokens", "-3"), ("run", "--max-tokens", "2.5"),
    ("run", "--temperature", "-1"), ("run", "--temperature", "nan"), ("run", "--top-p", "0"), ("run", "--top-p", "1.5"),
    ("run", "--top-k", "-1"), ("run", "--min-p", "1"), ("run", "--seed", str(2**64)), ("run", "--seed", "x"),
    ("run", "--max-context", "1"), ("run", "--capacity", "0"), ("run", "--warmup-tokens", "-1"),
    ("run", "--pin-top-k", "-2"), ("run", "--pin-threshold", "1.5"),
    ("bench", "--prompt-tokens", "0"), ("bench", "--gen-tokens", "-1"), ("bench", "--seed", "-1"),
    ("bench", "--temperature", "inf"), ("bench", "--capacity", "-4"), ("bench", "--max-context", "0"),
    ("perplexity", "--window", "1"), ("perplexity", "--max-tokens", "0"), ("perplexity", "--capacity", "x"),
    ("profile", "--max-tokens", "-1"), ("profile", "--chunk-tokens", "0"), ("profile", "--max-prompts", "0"),
    ("check", "--max-context", "-5"), ("check", "--capacity", "0"),
    ("run", "--kv-block-size", "0"), ("check", "--kv-block-size", "2048"),
    ("run", "--prefill-chunk", "0"), ("bench", "--prefill-chunk", "-512"), ("check", "--prefill-chunk", "x"),
]


@pytest.mark.parametrize("command,flag,value", NUMERIC)
def test_every_numeric_flag_has_a_range(tiny_qwen3, capsys, command, flag, value):
    extra = {"run": ["-p", "3 4"], "perplexity": ["--file", "x.py"], "profile": ["--prompts", "p.txt", "--out", "o.json"]}
    argv = [command, str(tiny_qwen3), *extra.get(command, []), flag, value]
    assert _exit_code(argv) == 1
    _one_line_error(capsys, flag)


def test_stdin_that_is_not_utf8_is_decoded_with_replacement(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moestream", "run", "--device", "cpu", "--max-tokens", "3"],
                          input=b"def f(x):\xff\xfe\n    return", capture_output=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr


def test_an_argument_that_is_not_utf8_is_decoded_with_replacement(capsys):
    assert cli_main(["run", "--device", "cpu", "--max-tokens", "3", "-p", "def \udcff\udcfe():"]) == 0


def test_a_corrupt_tokenizer_file_is_named(tmp_path, capsys):
    for name, content in (("tokenizer.json", "{\"model\": "), ("tokenizer_config.json", "[not json")):
        folder = tmp_path / name.replace(".", "_")
        shutil.copytree(DEMO_MODEL, folder)
        (folder / name).write_text(content)
        assert cli_main(["run", str(folder), "--device", "cpu", "-p", "x"]) == 1
        _one_line_error(capsys, name)


@pytest.mark.parametrize("prompt,bad", [("3 4 x5", "'x5'"), ("3 -4 5", "'-4'"), ("3 4.0", "'4.0'")])
def test_token_id_prompts_name_the_offending_token(tiny_qwen3, capsys, prompt, bad):
    assert cli_main(["run", str(tiny_qwen3), "--device", "cpu", "-p", prompt]) == 1
    _one_line_error(capsys, bad)


def test_chat_without_a_tokenizer_is_an_error(tiny_qwen3, capsys):
    assert cli_main(["run", str(tiny_qwen3), "--device", "cpu", "-p", "3 4", "--chat"]) == 1
    _one_line_error(capsys, "--chat")


def test_library_warnings_do_not_precede_our_message(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "tokenizer.json").write_text("{")
    proc = subprocess.run([sys.executable, "-m", "moestream", "run", str(folder), "--device", "cpu", "-p", "x"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("moestream: error:")


@pytest.mark.parametrize("argv,match", [
    (["run", "-p", "3 4", "--stats-json", "{tmp}/missing/stats.json"], "does not exist"),
    (["run", "-p", "3 4", "--stats-json", "{tmp}"], "is a folder"),
    (["bench", "--json", "{tmp}/nope/b.json"], "does not exist"),
    (["profile", "--prompts", "{tmp}/p.txt", "--out", "{tmp}"], "is a folder"),
    (["profile", "--prompts", "{tmp}/p.txt", "--out", "{tmp}/p.json", "--trace", "{tmp}/x/t.json"], "does not exist"),
    (["run", "-p", "3 4", "--prepack", "{tmp}/p.txt"], "is a file"),
])
def test_output_paths_are_checked_before_the_work(tiny_qwen3, tmp_path, capsys, monkeypatch, argv, match):
    (tmp_path / "p.txt").write_text("3 4 5\n")
    loads = []
    monkeypatch.setattr(moestream.engine.build, "build", lambda cfg: loads.append(cfg))
    args = [argv[0], str(tiny_qwen3), "--device", "cpu", *(a.format(tmp=tmp_path) for a in argv[1:])]
    assert cli_main(args) == 1
    _one_line_error(capsys, match)
    assert not loads   # refused before anything loaded


def test_a_failed_write_leaves_no_temporary_and_one_line(tiny_qwen3, tmp_path, capsys, monkeypatch):
    import moestream.fileio as fileio

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "replace", fail)
    out = tmp_path / "stats.json"
    assert cli_main(["run", str(tiny_qwen3), "--device", "cpu", "-p", "3 4", "--max-tokens", "2",
                     "--stats-json", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("moestream: error:") and "No space left" in err[-1]
    assert sum(line.startswith("moestream: error:") for line in err) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_prepack_that_could_not_be_saved_is_one_warning(tiny_qwen3, tmp_path, capsys, monkeypatch):
    import moestream.engine.build as build

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(build, "save_snapshot", fail)
    assert cli_main(["run", str(tiny_qwen3), "--device", "cpu", "-p", "3 4", "--max-tokens", "2", "--capacity", "3",
                     "--prepack", str(tmp_path / "snap")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "could not save" in err and "saved it to" not in err


# importing torch, loading, generating (in its first ~0.1 s the interpreter itself is starting up,
# where an interrupt is CPython's own business)
@pytest.mark.parametrize("delay", [0.3, 1.0, 3.0])
def test_ctrl_c_at_any_moment_exits_130_with_at_most_one_line(tmp_path, delay):
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "run", "--device", "cpu", "--max-tokens", "100000",
                             "-p", "def f(x):"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    text = err.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text and text.count("\n") <= 1


def test_ctrl_c_inside_an_import_is_raised_once_the_import_is_over(tmp_path):
    # an interrupt raised inside a C++ extension's import (torch.distributed's) aborts the process; one
    # landing in any import lets the module finish and raises right after it
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.3)\n"
        "for _ in range(200000):\n"
        "    pass\n"
        "print('module finished', flush=True)\n")
    script = (
        "from moestream.cli.interrupts import interrupts\n"
        "interrupts.install()\n"
        "try:\n"
        "    import slow_module\n"
        "    import time\n"
        "    time.sleep(5)\n"
        "    print('not raised', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('raised after the import', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"})
    assert done.stdout.split("\n")[:2] == ["module finished", "raised after the import"], done.stdout + done.stderr
    assert done.stderr == ""


def test_ctrl_c_inside_a_finalizer_is_remembered_without_a_traceback(tmp_path):
    # an interrupt landing in some library's __del__ cannot propagate; CPython would print it as
    # "Exception ignored in ..." with a traceback, and the run must still end at the next check
    script = (
        "import os, signal, time\n"
        "from moestream.cli.interrupts import interrupts\n"
        "interrupts.install()\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(1)\n"
        "Finalized()\n"
        "print('continued', flush=True)\n"
        "try:\n"
        "    interrupts.check()\n"
        "except KeyboardInterrupt:\n"
        "    print('raised at the check', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.split("\n")[:2] == ["continued", "raised at the check"], done.stdout + done.stderr
    assert done.stderr == ""
