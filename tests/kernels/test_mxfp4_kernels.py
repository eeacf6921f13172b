"""The MXFP4 kernels (one pair per program, grouped) against the reference: under Triton's interpreter
on the CPU and compiled on a GPU, in fp32 and in bf16 (the dtype a GPU engine runs them in)
(kernels/fused_moe_mxfp4_triton.py, spec kernels/mxfp4_moe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moestream import kernels
from triton_interpreter import INTERPRETER_SKIP, check_all_under_interpreter

CHECKS = Path(__file__).with_name("mxfp4_checks.py")


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_mxfp4_kernels_under_triton_interpreter():
    check_all_under_interpreter(CHECKS, dtypes="torch.float32, torch.bfloat16")


@pytest.mark.skipif(not kernels.fused_moe_available(), reason="needs a CUDA GPU and Triton")
def test_mxfp4_kernels_on_gpu():
    import sys

    sys.path.insert(0, str(CHECKS.parent))
    from mxfp4_checks import check_all

    check_all("cuda", (torch.float32, torch.bfloat16))
