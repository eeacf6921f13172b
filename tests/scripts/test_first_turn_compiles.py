"""benchmarks/first_turn_compiles.py: an engine loaded and warmed up as a server, its first turns timed."""

from __future__ import annotations

import json
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_turns_after_a_warm_up_are_timed_and_extend_one_conversation(tmp_path):
    """The demo on the CPU (nothing compiles there): four turns, the second as long as the first with new ids,
    the third the first prompt, its reply and 6 new tokens, the fourth that again; each timed with a count."""
    run = run_script(ROOT / "benchmarks" / "first_turn_compiles.py", "--ckpt", str(ROOT / "moestream" / "demo_model"),
                     "--out", str(tmp_path), "--device", "cpu", "--prompt-tokens", "40", "--new-tokens", "6",
                     "--gen-tokens", "2", "--prefix-cache-memory", "64MiB", "--temperature", "0.7", "--top-k", "20",
                     timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "first_turn_compiles.json").read_text())
    turns = result["turns"]
    assert [t["prompt_tokens"] for t in turns] == [40, 40, 48, 56]
    assert all(t["seconds"] > 0 and t["variants_compiled"] == 0 and t["kernels"] == {} for t in turns)
    assert result["warm_up_s"] > 0 and result["device"] == "cpu" and result["routing"] == "model"
    assert result["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0}
    assert "first prompt: 40 tokens" in run.stdout and "the turn after: 56 tokens" in run.stdout


def test_a_grown_count_names_each_kernel_that_compiled():
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.first_turn_compiles import grown

    assert grown({"a": 2, "b": 1}, {"a": 3, "b": 1, "c": 2}) == {"a": 1, "c": 2}
    assert grown({"a": 2}, {"a": 2}) == {}
