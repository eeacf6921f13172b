"""The one-token MoE path: compiled on a GPU, under the interpreter on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from token_moe_checks import check_all
from triton_interpreter import INTERPRETER_SKIP, check_all_under_interpreter

from moestream.kernels import fused_moe_available


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_token_path_under_interpreter():
    """fp32 only: the interpreter takes ~25 s a dtype; the GPU test takes all three."""
    check_all_under_interpreter(Path(__file__).parent / "token_moe_checks.py", dtypes="torch.float32")


@pytest.mark.skipif(not fused_moe_available(), reason="needs CUDA and Triton")
def test_token_path_on_gpu():
    check_all("cuda", (torch.float32, torch.bfloat16, torch.float16))
