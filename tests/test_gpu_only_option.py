"""`pytest --gpu-only` keeps exactly the tests whose skip condition says they need a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_only_keeps_the_tests_that_need_a_gpu():
    """Run in one process (-n 0: no workers started), each kept test named on its line (-v)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--gpu-only", "-n", "0",
                          "tests/experts/test_hybrid_policy.py", "tests/kernels/test_fused_moe_token.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]   # every GPU test skipped here, none failed
    kept = [line.split()[0] for line in run.stdout.splitlines() if "::" in line]
    assert {k.split("::")[0] for k in kept} == {"tests/experts/test_hybrid_policy.py",
                                                 "tests/kernels/test_fused_moe_token.py"}, kept
    assert all("gpu" in k for k in kept), kept                      # the GPU tests of both files
    assert not any("under_interpreter" in k for k in kept)          # "needs Triton and no GPU": the CPU's check
    assert "deselected" in run.stdout
    assert "created:" not in run.stdout                             # -n 0 keeps one process


def test_gpu_only_runs_in_worker_processes_and_the_workers_start_none_of_their_own():
    """--gpu-only starts conftest.GPU_WORKERS workers (pytest-xdist; MOESTREAM_TEST_GPU_WORKERS where set)
    unless -n is given (-n 0: the test above); a worker, which sees --gpu-only too, runs what it is sent
    instead of starting workers itself."""
    workers = 2   # fewer than conftest's default (each worker is a torch import); the count set is the count started
    env = {**os.environ, "MOESTREAM_TEST_GPU_WORKERS": str(workers)}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--gpu-only", "tests/kernels/test_sampling_kernel.py"]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]   # every GPU test skipped here, none failed
    assert f"created: {workers}/{workers} workers" in run.stdout
    assert run.stdout.count("created:") == 1                          # no worker started workers of its own
