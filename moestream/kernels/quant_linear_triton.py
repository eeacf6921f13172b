"""A linear layer over a quantized weight on CUDA: the path of `quant_linear_reference` there.

One row (batch-1 decode) takes the quantized GEMV (quant_gemv_triton.py) where its format allows.
For a few tokens the weight is one "expert" of the decode MoE kernel that every token is routed to
with weight 1 and no activation: each row of packed bytes is read once and dequantized in
registers. For prompts the weight is dequantized once into the hidden dtype by one Triton launch
(dequant_slots_triton.py: a pass that only streams memory) and one cuBLAS GEMM runs (a prompt's
FLOPs dwarf the extra weight pass).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from moestream.quant import QuantSpec, dequantize

from .dequant_slots_triton import dequantize_operand
from .fused_moe_decode import QUANT_DECODE_CONFIG, decode_launch
from .fused_moe_quant_triton import quant_operand
from .quant_gemv_triton import quant_gemv, quant_gemv_supported
from .switch import Switch

__all__ = ["quant_gemv_path", "quant_linear"]

DECODE_MAX_TOKENS = 16

_gemv_on = Switch()


def quant_gemv_path(enabled: bool):
    """Switch the one-row quantized GEMV on or off inside the block (A/B benchmarks; graphs captured
    inside keep the choice)."""
    return _gemv_on.set(enabled)


def quant_linear(x: Tensor, qweight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec,
                 bias: Tensor | None = None) -> Tensor:
    T, K = x.shape
    N = qweight.shape[0]
    if T == 1 and _gemv_on.on and quant_gemv_supported(spec, K) and qweight.stride(-1) == 1:
        return quant_gemv(x, qweight, scales, biases, spec, bias)
    parts = {"w.qweight": qweight[None], "w.scales": scales[None]}
    if biases is not None:
        parts["w.biases"] = biases[None]
    operand = quant_operand(parts, "w", spec)
    if T > DECODE_MAX_TOKENS:
        if qweight.stride(-1) != 1:
            return F.linear(x, dequantize(qweight, scales, biases, spec, x.dtype), bias)
        return F.linear(x, dequantize_operand(operand, K, x.dtype, gated=False)[0], bias)
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    slot_ids = torch.zeros((T, 1), dtype=torch.int32, device=x.device)
    tile = QUANT_DECODE_CONFIG.down
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        decode_launch(x, qweight[None], out, slot_ids, out, n=N, k=K, num_slots=1, a_by_token=True, gated=False,
                activation_code=0, mul_weight=False, block_m=DECODE_MAX_TOKENS, tile=tile, quant=operand)
    return out + bias if bias is not None else out
