"""`pytest --gpu-only` keeps exactly the tests whose skip condition says they need a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_only_keeps_the_tests_that_need_a_gpu():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "--gpu-only", "tests/experts/test_hybrid_policy.py", "tests/kernels/test_fused_moe_token.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    kept = [line for line in run.stdout.splitlines() if "::" in line]
    assert kept and all("gpu" in line for line in kept), kept          # the GPU tests of both files
    assert not any("under_interpreter" in line for line in kept)   # "needs Triton and no GPU": the CPU's check
    assert "deselected" in run.stdout
