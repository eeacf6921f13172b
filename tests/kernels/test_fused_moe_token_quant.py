"""One token's quantized experts (the one-token path of packed banks): compiled on a GPU, under the
interpreter on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


pytest.importorskip("triton", reason="the kernels are Triton code: install the test extra on Linux")
from quant_token_checks import CASES, check_quant_token  # noqa: E402
from triton_interpreter import INTERPRETER_SKIP, run_checks_under_interpreter  # noqa: E402

from moestream.kernels import fused_moe_quant_available  # noqa: E402
from moestream.kernels.fused_moe_token_quant import token_path_supported  # noqa: E402
from moestream.quant import parse_quant  # noqa: E402


def test_the_one_token_path_covers_the_common_formats_and_leaves_the_rest_to_the_decode_path():
    assert all(token_path_supported(parse_quant(f), 2048, 768) for f in ("int4", "int4-g128", "int8", "int2", "nf4"))
    assert not token_path_supported(parse_quant("int3"), 2048, 768), "3-bit values straddle the words"
    assert not token_path_supported(parse_quant("nf3"), 2048, 768)
    assert not token_path_supported(parse_quant("int4-g128"), 2880, 2880), "a ragged last group"


@pytest.mark.skipif(**INTERPRETER_SKIP)
def test_quant_token_path_under_interpreter():
    """One small case in fp32: affine 4-bit with fp16 scales (GGUF's Q4_0) and a partial last K step (the
    interpreter takes ~35 s a case; the GPU test takes every format, NF4's codebook included, and three dtypes)."""
    run_checks_under_interpreter(Path(__file__).with_name("quant_token_checks.py"), """
        check_quant_token("cpu", torch.float32, "int4-g32:fp16", 96, 32)
    """, timeout=600)


# every format in bf16; the other activation dtypes on one format (the dtype changes loads and casts only)
GPU_CASES = [(*case, torch.bfloat16) for case in CASES] + [(*CASES[1], dt) for dt in (torch.float16, torch.float32)]


@pytest.mark.skipif(not fused_moe_quant_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("fmt,H,I,dtype", GPU_CASES)
def test_quant_token_path_on_gpu(fmt, H, I, dtype):
    check_quant_token("cuda", dtype, fmt, H, I)
