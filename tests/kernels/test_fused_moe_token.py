"""The one-token MoE path: compiled on a GPU, under the interpreter on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from token_moe_checks import check_all
from triton_interpreter import INTERPRETER_SKIP, run_checks_under_interpreter

from moestream.kernels import fused_moe_available


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_token_path_under_interpreter():
    """fp32 only, at the smaller widths of INTERPRETER_SHAPES (the same whole and partial K steps): the
    interpreter runs every program in Python; the GPU test takes all three dtypes at the full widths."""
    run_checks_under_interpreter(Path(__file__).parent / "token_moe_checks.py",
                                 "check_all('cpu', (torch.float32,), **INTERPRETER_SHAPES)")


@pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")
def test_token_path_on_gpu():
    check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))
