"""Plain-torch linear layer over a quantized weight: the spec of the dequantizing linear kernel.

out = x @ dequantize(qweight, scales, biases)ᵀ (+ bias): the weight is dequantized to x's dtype
with fp32 math (moestream.quant.dequantize), then one GEMM. Used by `QuantLinear` on the CPU and
wherever the Triton kernel is not available.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from moestream.quant import QuantSpec, dequantize


def quant_linear_reference(x: Tensor, qweight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec,
                           bias: Tensor | None = None) -> Tensor:
    return F.linear(x, dequantize(qweight, scales, biases, spec, x.dtype), bias)
