"""benchmarks/step_host_time.py times a decode step's host parts: a smoke run on the CPU with a tiny
checkpoint and the hybrid miss policy (no graphs there: the parts the CPU has)."""

from __future__ import annotations

from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_host_parts_of_a_step_are_timed(tiny_qwen3):
    run = run_script(ROOT / "benchmarks" / "step_host_time.py", str(tiny_qwen3),
                     "--device", "cpu", "--capacity", "3", "--miss-policy", "hybrid", "--steps", "6",
                     "--prompt-tokens", "12", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    blocks: dict[str, dict[str, float]] = {}
    for line in run.stdout.splitlines():
        if "ms per step" in line:
            parts = blocks.setdefault(line.split(":")[0], {})
        else:
            parts[line.split(" us per step")[0].rsplit(None, 1)[0].strip()] = float(line.split()[-4])
    assert list(blocks) == ["overlap off", "overlap on"]                  # both modes, in that order
    for parts in blocks.values():
        assert {"begin_step (before the replay)", "after_step (after the replay)", "token read (waits for the device)",
                "rest of engine.step"} <= set(parts)
        assert all(v >= 0 for v in parts.values())
