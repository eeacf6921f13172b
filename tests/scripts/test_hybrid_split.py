"""benchmarks/hybrid_split.py sets each variant's split and refresh on one loaded engine: a smoke run
on the CPU with a tiny checkpoint (the CPU stands in for the device, the hybrid protocol is the same)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_variant_runs_with_its_own_split_and_refresh(tiny_qwen3, tmp_path):
    variants = ["0.25", "0.75:whole", "auto", "0.5:every2", "0.5:nopromote"]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hybrid_split.py"), "--ckpt", str(tiny_qwen3),
                          "--out", str(tmp_path), "--device", "cpu", "--capacity", "3", "--rounds", "1",
                          "--routing", "uniform", "--prompt-tokens", "24", "16", "--gen-tokens", "10",
                          "--variants", *variants], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "hybrid_split.json").read_text())["rows"]}
    assert list(rows) == variants
    assert rows["0.25"]["share_at_end"] == 0.25 and rows["0.75:whole"]["share_at_end"] == 0.75   # fixed shares stay
    assert rows["0.5:nopromote"]["copied_mb"] == 0          # no refresh: nothing copied into the bank
    assert all(r["decode_tok_s"] > 0 and 0 <= r["hit_rate"] <= 1 for r in rows.values())


def test_a_bad_variant_is_refused_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hybrid_split.py"), "--ckpt", str(tmp_path),
                          "--out", str(tmp_path), "--variants", "0.6:fast"], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode != 0 and "unknown variant flag 'fast'" in run.stderr and "Traceback" not in run.stderr
