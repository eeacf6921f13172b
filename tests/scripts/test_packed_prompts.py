"""benchmarks/packed_prompts.py: prompts admitted together, packed against one forward each, on the CPU
with a tiny checkpoint and a bounded bank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_modes_run_the_same_prompts_and_packing_copies_fewer_experts(tiny_qwen3, tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packed_prompts.py"), "--ckpt", str(tiny_qwen3),
                          "--out", str(tmp_path), "--device", "cpu", "--capacity", "3", "--streams", "4",
                          "--prompt-tokens", "6", "--rounds", "1", "--routing", "uniform"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "packed_prompts.json").read_text())
    packed, each = result["modes"]["packed"], result["modes"]["one each"]
    assert packed["forwards"] == 1 and each["forwards"] == 4
    assert 0 < packed["gb_copied"] < each["gb_copied"]
    assert result["routing"].startswith("uniform") and result["speedup"] > 0
    assert "packed" in run.stdout and "one forward each" in run.stdout
