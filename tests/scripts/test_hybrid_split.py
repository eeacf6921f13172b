"""benchmarks/hybrid_split.py sets each variant's split and refresh on one loaded engine: a smoke run
on the CPU with a tiny checkpoint (the CPU stands in for the device, the hybrid protocol is the same)."""

from __future__ import annotations

import json
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_each_variant_runs_with_its_own_split_and_refresh(tiny_qwen3, tmp_path):
    variants = ["0.25", "0.75:whole", "auto", "0.5:every2", "0.5:nopromote", "0.5:pf0", "auto:eager:sync"]
    run = run_script(ROOT / "benchmarks" / "hybrid_split.py", "--ckpt", str(tiny_qwen3),
                     "--out", str(tmp_path), "--device", "cpu", "--capacity", "3", "--rounds", "1",
                     "--routing", "uniform", "--prompt-tokens", "24", "16", "--gen-tokens", "10",
                     "--variants", *variants, "--timeline", "2", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "timeline: the profiler saw no kernels" in run.stderr + run.stdout   # the CPU has no CUDA kernels
    rows = {r["variant"]: r for r in json.loads((tmp_path / "hybrid_split.json").read_text())["rows"]}
    assert list(rows) == variants
    assert rows["0.25"]["share_at_end"] == 0.25 and rows["0.75:whole"]["share_at_end"] == 0.75   # fixed shares stay
    assert rows["0.5:nopromote"]["copied_mb"] == 0          # no refresh: nothing copied into the bank
    assert all(r["decode_tok_s"] > 0 and 0 <= r["hit_rate"] <= 1 for r in rows.values())


def _rows(folder, out, *extra):
    run = run_script(ROOT / "benchmarks" / "hybrid_split.py", "--ckpt", str(folder),
                     "--out", str(out), "--device", "cpu", "--capacity", "3", "--rounds", "1",
                     "--routing", "uniform", "--prompt-tokens", "24", "16", "--gen-tokens", "12",
                     "--variants", "0.5", "0.5", "0.5", *extra, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads((out / "hybrid_split.json").read_text())["rows"]


def test_cold_rows_start_from_the_bank_as_loaded(tiny_qwen3, tmp_path):
    """With --cold every row starts from the loaded bank and draws the same routing, so the same
    variant gives the same hits and copies each time; without it the bank carries over."""
    cold = _rows(tiny_qwen3, tmp_path / "cold", "--cold")
    assert len({(r["hit_rate"], r["copied_mb"]) for r in cold}) == 1
    warm = _rows(tiny_qwen3, tmp_path / "warm")
    assert warm[0]["hit_rate"] == cold[0]["hit_rate"]                  # the first row starts as loaded either way
    assert len({(r["hit_rate"], r["copied_mb"]) for r in warm}) > 1    # later ones start where the last left it


def test_a_bad_variant_is_refused_in_one_line(tmp_path):
    run = run_script(ROOT / "benchmarks" / "hybrid_split.py", "--ckpt", str(tmp_path),
                     "--out", str(tmp_path), "--variants", "0.6:fast", timeout=60)
    assert run.returncode != 0 and "unknown variant flag 'fast'" in run.stderr and "Traceback" not in run.stderr
