"""benchmarks/sampling_time.py times sampling against filtering the whole row and against the torch top-k
draw: a smoke run on the CPU with a small vocabulary (every setting timed three ways)."""

from __future__ import annotations

from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_timed_three_ways():
    run = run_script(ROOT / "benchmarks" / "sampling_time.py", "--device", "cpu",
                     "--vocab", "2000", "--calls", "3", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = run.stdout.splitlines()[1:]
    assert len(rows) == 6 and rows[0].startswith("greedy") and any("top-k 20" in r for r in rows)
    for row in rows:
        old, torch_draw, new, ratio = row.split()[-4:]
        assert float(old) > 0 and float(torch_draw) > 0 and float(new) > 0 and ratio.endswith("x")
