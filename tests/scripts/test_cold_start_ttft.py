"""benchmarks/cold_start_ttft.py: a fresh `moestream run` per checkpoint, timed to its first token."""

from __future__ import annotations

import json
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_each_checkpoint_is_timed_in_a_fresh_process_and_a_failure_is_its_row(tmp_path):
    """The demo model from a fresh process: wall time to exit covers its load and its prompt; a checkpoint
    that cannot load is a row with the CLI's own error, not a crash of the whole comparison."""
    run = run_script(ROOT / "benchmarks" / "cold_start_ttft.py", "--out", str(tmp_path),
                     "--ckpt", f"demo={ROOT / 'moestream' / 'demo_model'}", "--ckpt", f"gone={tmp_path / 'none'}",
                     "--repeats", "1", "--device", "cpu", "--prompt-tokens", "16", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    demo, gone = json.loads((tmp_path / "cold_start_ttft.json").read_text())["rows"]
    assert demo["name"] == "demo" and demo["wall_vs_first"] == 1.0
    assert demo["median_wall_s"] > demo["median_load_s"] > 0 and demo["median_ttft_s"] > 0
    assert demo["prompt_tokens"] >= 16 and demo["runs"][0]["device"] == "cpu"
    assert "does not exist" in gone["error"]
    assert "demo: first token" in run.stdout and "gone: failed" in run.stdout
