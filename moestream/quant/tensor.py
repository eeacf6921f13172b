"""Quantize and dequantize one (N, K) weight in any QuantSpec: the reference every format and kernel follows.

A quantized weight is three tensors: `qweight` (N, K·bits/8) uint8 in the packing.py layout,
`scales` (N, ⌈K/group⌉) and, for affine specs, `biases` (N, ⌈K/group⌉), both in the spec's scale
dtype; when the group does not divide K, each row's last group is the shorter rest.
Rows are processed in chunks so a large weight (an embedding table) never needs more than a
chunk's worth of fp32 temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moestream.quant import affine, normal
from moestream.quant.fp8 import Fp8Spec, dequantize_fp8
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
        rows = w[start:start + ROWS_PER_CHUNK].float()
        parts = [_quantize_part(part, spec) for part in _split(rows, spec.group)]
        qs.append(pack(torch.cat([p[0] for p in parts], dim=1), spec.bits))
        scales.append(torch.cat([p[1] for p in parts], dim=1))
        if spec.kind == "int":
            biases.append(torch.cat([p[2] for p in parts], dim=1))
    return QuantizedTensor(torch.cat(qs), torch.cat(scales), torch.cat(biases) if biases else None, spec)


def _split(x: Tensor, group: int) -> list[Tensor]:
    """(n, K) → the whole groups (n, K//g, g) and, when K is not a multiple, the rest (n, 1, K % g)."""
    n, k = x.shape
    whole = k // group * group
    out = [x[:, :whole].reshape(n, -1, group)] if whole else []
    if whole < k:
        out.append(x[:, whole:].reshape(n, 1, k - whole))
    return out


def _quantize_part(wg: Tensor, spec: QuantSpec) -> tuple[Tensor, ...]:
    """Groups (n, G, g) → values (n, G·g), scales (n, G) [, biases (n, G)]."""
    if spec.kind == "int":
        q, s, b = affine.quantize_groups(wg, spec.bits, spec.scale_dtype)
        return q.reshape(q.shape[0], -1), s, b
    q, s = normal.quantize_groups(wg, spec.bits, spec.scale_dtype)
    return q.reshape(q.shape[0], -1), s


def dequantize(qweight: Tensor, scales: Tensor, biases: Tensor | None, spec: QuantSpec | Fp8Spec,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The (N, K) weight the quantized tensors stand for, in `dtype` (math in fp32). An FP8 spec's
    `qweight` is the e4m3 bytes and `scales` its block grid (`quant/fp8.py`)."""
    if isinstance(spec, Fp8Spec):
        return dequantize_fp8(qweight, scales, spec, dtype)
    *lead, width = qweight.shape
    k = width * 8 // spec.bits
    q = unpack(qweight, spec.bits).reshape(-1, k)
    scales = scales.reshape(q.shape[0], -1)
    biases = biases.reshape(q.shape[0], -1) if biases is not None else None
    out, g0 = [], 0
    for part in _split(q, spec.group):
        g1 = g0 + part.shape[1]
        if spec.kind == "int":
            out.append(affine.dequantize_groups(part, scales[:, g0:g1], biases[:, g0:g1]))
        else:
            out.append(normal.dequantize_groups(part, scales[:, g0:g1], spec.bits))
        g0 = g1
    return torch.cat([o.reshape(o.shape[0], -1) for o in out], dim=1).reshape(*lead, k).to(dtype)
