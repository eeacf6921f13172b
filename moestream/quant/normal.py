"""Normal-float group quantization: w ≈ code[q]·scale, one scale (the clipped absmax) per group.

The codebook places 2^bits levels at quantiles of a standard normal (asymmetric: one more level
on the positive side, and an exact zero), normalised to [-1, 1], as QLoRA's NF4 does; the same
construction gives NF3's 8 levels. Weights of trained layers are close to normal within a group,
so equal-probability levels spend the bits where the values are.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8)
OFFSET = 0.9677083   # QLoRA's: the outermost quantile, chosen so both ends carry equal mass


@functools.lru_cache(maxsize=None)
def codebook(bits: int) -> Tensor:
    """The 2^bits sorted levels in [-1, 1] (fp32, CPU)."""
    positive, negative = 1 << (bits - 1), (1 << (bits - 1)) - 1
    ppf = torch.special.ndtri
    pos = ppf(torch.linspace(OFFSET, 0.5, positive + 1, dtype=torch.float64)[:-1])
    neg = -ppf(torch.linspace(OFFSET, 0.5, negative + 1, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (levels / levels.abs().max()).float()


def quantize_groups(wg: Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """wg (n, G, g) fp32 → q (n, G, g) uint8 codebook indices, scales (n, G) in scale_dtype."""
    code = codebook(bits).to(wg.device)
    edges = (code[1:] + code[:-1]) / 2
    absmax = wg.abs().amax(-1)
    best = None
    for factor in CLIP_FACTORS:
        scale = (absmax * factor).clamp_min(1e-12).to(scale_dtype).float()
        scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).tiny), scale)
        q = torch.bucketize((wg / scale[..., None]).clamp_(-1, 1), edges)
        err = (code[q] * scale[..., None] - wg).square_().sum(-1)
        if best is None:
            best = [err, q, scale]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better[..., None], q, best[1])
        best[2] = torch.where(better, scale, best[2])
    _, q, scale = best
    return q.to(torch.uint8), scale.to(scale_dtype)


def dequantize_groups(q: Tensor, scales: Tensor, bits: int) -> Tensor:
    """q (n, G, g) uint8 indices, scales (n, G) → fp32 (n, G, g)."""
    return codebook(bits).to(q.device)[q.long()] * scales.float()[..., None]
