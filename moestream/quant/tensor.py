"""Quantize and dequantize one (N, K) weight in any QuantSpec: the reference every format and kernel follows.

A quantized weight is three tensors: `qweight` (N, K·bits/8) uint8 in the packing.py layout,
`scales` (N, K/group) and, for affine specs, `biases` (N, K/group), both in the spec's scale dtype.
Rows are processed in chunks so a large weight (an embedding table) never needs more than a
chunk's worth of fp32 temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moestream.quant import affine, normal
from moestream.quant.packing import pack, unpack
from moestream.quant.spec import QuantSpec

ROWS_PER_CHUNK = 1024


@dataclass
class QuantizedTensor:
    qweight: Tensor
    scales: Tensor
    biases: Tensor | None
    spec: QuantSpec

    def parts(self) -> dict[str, Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.biases is not None:
            out["biases"] = self.biases
        return out


def quantize(w: Tensor, spec: QuantSpec) -> QuantizedTensor:
    """(N, K) float weight → QuantizedTensor (on w's device)."""
    n, k = w.shape
    spec.check_width(k)
    qs, scales, biases = [], [], []
    for start in range(0, n, ROWS_PER_CHUNK):
        wg = w[start:start + ROWS_PER_CHUNK].float().reshape(-1, k // spec.group, spec.group)
        if spec.kind == "int":
            q, s, b = affine.quantize_groups(wg, spec.bits, spec.scale_dtype)
            biases.append(b)
        else:
            q, s = normal.quantize_groups(wg, spec.bits, spec.scale_dtype)
        qs.append(pack(q.reshape(q.shape[0], k), spec.bits))
        scales.append(s)
    return QuantizedTensor(torch.cat(qs), torch.cat(scales), torch.cat(biases) if biases else None, spec)


def dequantize(qweight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) weight the quantized tensors stand for, in `dtype` (math in fp32)."""
    *lead, width = qweight.shape
    k = width * 8 // spec.bits
    q = unpack(qweight, spec.bits).reshape(*lead, k // spec.group, spec.group)
    if spec.kind == "int":
        w = affine.dequantize_groups(q, scales, biases)
    else:
        w = normal.dequantize_groups(q, scales, spec.bits)
    return w.reshape(*lead, k).to(dtype)
