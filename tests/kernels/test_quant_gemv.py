"""The one-row quantized GEMV (the batch-1 projections of quantized dense layers): compiled on a GPU,
under the interpreter on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


pytest.importorskip("triton", reason="the kernels are Triton code: install the test extra on Linux")
from quant_gemv_checks import CASES, check_quant_gemv  # noqa: E402
from triton_interpreter import INTERPRETER_SKIP, check_all_under_interpreter  # noqa: E402

from moestream.kernels import fused_moe_quant_available  # noqa: E402
from moestream.kernels.quant_gemv_triton import quant_gemv_supported  # noqa: E402
from moestream.quant import parse_quant  # noqa: E402


def test_the_gemv_covers_the_common_formats_and_leaves_the_rest_to_the_decode_path():
    assert all(quant_gemv_supported(parse_quant(f), 2048) for f in ("int4", "int4-g128", "int8", "int2", "nf4"))
    assert not quant_gemv_supported(parse_quant("int3"), 2048), "3-bit values straddle the words"
    assert not quant_gemv_supported(parse_quant("nf3"), 2048)
    assert not quant_gemv_supported(parse_quant("int4-g128"), 2880), "a ragged last group"


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_quant_gemv_under_interpreter():
    """Every case in fp32 (the GPU test takes every case in bf16, one in three dtypes)."""
    check_all_under_interpreter(Path(__file__).with_name("quant_gemv_checks.py"), timeout=600, dtypes="torch.float32")


# every case in bf16; fp16 and fp32 on the first (the dtype changes loads and casts only)
GPU_CASES = [(*case, torch.bfloat16) for case in CASES] + [(*CASES[0], dt) for dt in (torch.float16, torch.float32)]


@pytest.mark.skipif(not fused_moe_quant_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("fmt,N,K,dtype", GPU_CASES)
def test_quant_gemv_on_gpu(fmt, N, K, dtype):
    check_quant_gemv("cuda", dtype, fmt, N, K)
