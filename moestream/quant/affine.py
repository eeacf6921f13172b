"""Affine group quantization: w ≈ q·scale + bias, q in [0, 2^bits), one (scale, bias) per group.

Per group the range [min, max] is fitted, then shrunk by a few clip factors toward zero: a group
whose values are spread evenly keeps its full range, a group with one outlier trades that outlier's
error for finer steps everywhere else. The factor with the smallest squared error wins. Scales and
biases are rounded to their storage dtype *before* the values are rounded, so the error measured is
the error the dequantizer will see.
"""

from __future__ import annotations

import torch
from torch import Tensor

CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.7)



def quantize_groups(wg: Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """wg (n, G, g) fp32 → q (n, G, g) uint8, scales (n, G), biases (n, G) in scale_dtype."""
    top = float((1 << bits) - 1)
    mn, mx = wg.amin(-1), wg.amax(-1)
    best = None
    for factor in CLIP_FACTORS:
        lo, hi = mn * factor, mx * factor
        scale = ((hi - lo) / top).clamp_min(1e-12).to(scale_dtype).float()
        scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).tiny), scale)
        bias = lo.to(scale_dtype).float()
        q = ((wg - bias[..., None]) / scale[..., None]).round_().clamp_(0, top)
        err = (q * scale[..., None] + bias[..., None] - wg).square_().sum(-1)
        if best is None:
            best = [err, q, scale, bias]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better[..., None], q, best[1])
        best[2] = torch.where(better, scale, best[2])
        best[3] = torch.where(better, bias, best[3])
    _, q, scale, bias = best
    return q.to(torch.uint8), scale.to(scale_dtype), bias.to(scale_dtype)


def dequantize_groups(q: Tensor, scales: Tensor, biases: Tensor) -> Tensor:
    """q (n, G, g) uint8, scales/biases (n, G) → fp32 (n, G, g)."""
    return q.float() * scales.float()[..., None] + biases.float()[..., None]
