"""MXFP4 (the OCP microscaling FP4 format gpt-oss ships its experts in): the plain-torch reference.

A weight (N, K) is stored as `blocks` uint8 (N, K/32, 16) and `scales` uint8 (N, K/32): every run of
32 consecutive values of a row shares one e8m0 scale 2^(s - 127), and each value is an fp4 e2m1 code
(sign bit 3, then a magnitude index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes a byte, the value of
even column 2j in the low nibble and 2j + 1 in the high one (transformers' `convert_moe_packed_tensors`
order). 4.25 bits a weight. The dequantizing kernels and the expert format follow this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moestream.errors import InputError

GROUP = 32                  # values per e8m0 scale
BLOCK_BYTES = GROUP // 2    # bytes per group: two fp4 codes a byte
SCALE_BIAS = 127            # e8m0: 2^(s - 127)
# fp4 e2m1 by code: magnitudes for codes 0-7, the same negated for 8-15 (the sign bit)
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_MAGNITUDES + tuple(-v for v in FP4_MAGNITUDES)


@dataclass(frozen=True)
class Mxfp4Spec:
    """What a layer's experts are stored in when they are MXFP4 (the one variant there is: 32-value
    groups, e8m0 scales); compared by the expert store as the other stored specs are."""

    name: str = "mxfp4"
    bits: int = 4
    group: int = GROUP

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of one (n, k) weight: packed codes and one scale byte a group."""
        return n * (k // 2 + k // GROUP)


MXFP4 = Mxfp4Spec()


def check_width(k: int, what: str) -> None:
    if k % GROUP:
        raise InputError(f"{what} ({k}) is not a multiple of {GROUP}, so it cannot be held in MXFP4 (one scale "
                         f"per {GROUP} values); keep the experts in bf16.")


def lut(device: torch.device | str = "cpu") -> Tensor:
    return torch.tensor(FP4_VALUES, dtype=torch.float32, device=device)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks (..., N, G, 16) or (..., N, G·16) uint8 and scales (..., N, G) uint8 → (..., N, 32·G) in
    `dtype`. Every product code × 2^(s - 127) is exact in fp32 (3 significant bits, e8m0 exponents
    inside fp32's range but for the extremes, which ldexp takes to 0 / inf as the definition does)."""
    *lead, G = scales.shape
    codes = blocks.reshape(*lead, G, BLOCK_BYTES)
    table = lut(blocks.device)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)   # low nibble first
    values = values.reshape(*lead, G, GROUP)
    out = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None].float())
    return out.reshape(*lead, G * GROUP).to(dtype)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """(..., N, K) float → blocks (..., N, K/32, 16) and scales (..., N, K/32): each group's scale the
    smallest power of two that puts its largest magnitude within 6, each value rounded to the nearest
    fp4 value (ties to the lower magnitude). What tests and the random-checkpoint writer store; the
    published checkpoints come quantized already."""
    *lead, k = w.shape
    check_width(k, "the input dimension")
    groups = w.float().reshape(*lead, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127).to(torch.int32)
    scaled = torch.ldexp(groups, -exponent[..., None].float()).clamp(-6.0, 6.0)
    magnitudes = torch.tensor(FP4_MAGNITUDES, device=w.device)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)   # first (lower) magnitude on a tie
    codes = (index | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    codes = codes.reshape(*lead, k // GROUP, BLOCK_BYTES, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


def mxfp4_quantization(raw: dict) -> bool:
    """Whether config.json declares gpt-oss's MXFP4 experts (`quantization_config.quant_method = "mxfp4"`;
    the modules it lists in `modules_to_not_convert` are stored in bf16 as every other dense one)."""
    q = raw.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"
