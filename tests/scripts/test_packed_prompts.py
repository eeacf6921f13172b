"""benchmarks/packed_prompts.py: prompts admitted together, packed against one forward each, on the CPU
with a tiny checkpoint and a bounded bank."""

from __future__ import annotations

import json
from pathlib import Path

from fork_server import run_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_modes_run_the_same_prompts_and_filled_packed_steps_copy_fewest_experts(tiny_qwen3, tmp_path):
    """4 prompts of 6 tokens in steps of 8: filled packed steps are 3 forwards (8, 8, 8), packed steps of
    whole prompts 4 (one prompt a step: the next does not fit what is left), one forward each 4."""
    run = run_script(ROOT / "benchmarks" / "packed_prompts.py", "--ckpt", str(tiny_qwen3),
                     "--out", str(tmp_path), "--device", "cpu", "--capacity", "3", "--streams", "4",
                     "--prompt-tokens", "6", "--prefill-chunk", "8", "--rounds", "1", "--routing", "uniform", timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "packed_prompts.json").read_text())
    packed, whole, each = (result["modes"][m] for m in ("packed", "packed, whole", "one each"))
    assert (packed["forwards"], whole["forwards"], each["forwards"]) == (3, 4, 4)
    assert 0 < packed["gb_copied"] < whole["gb_copied"] and packed["gb_copied"] < each["gb_copied"]
    assert result["fill_speedup"] > 0
    assert result["routing"].startswith("uniform") and result["speedup"] > 0
    assert "packed" in run.stdout and "one forward each" in run.stdout
