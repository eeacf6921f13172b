"""Rotary position embeddings: a cos/sin table computed once, indexed by absolute position.

The table is built exactly as transformers builds its per-call cos/sin (fp32 outer product of
positions and inverse frequencies, times the attention scaling), so lookups match it bit for bit.
Partial rotary (GLM: `ModelConfig.rotary_dim` < head_dim) needs no other code: the table is only
rotary_dim wide, and `apply_rotary` rotates the leading dims that wide and passes the rest through.
The layout is the half-split one (rotate_half) in the GQA families, GLM-4.5 included; DeepSeek's
multi-head latent attention rotates adjacent pairs instead (`apply_rotary_interleaved`), from the
same table.
"""

from __future__ import annotations

import math

import torch

from moestream import kernels
from moestream.archs.spec import ModelConfig, RopeConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(rope: RopeConfig, dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (used by Qwen3 for long context): blend interpolated and extrapolated frequencies."""
    factor = rope.factor
    original = rope.original_max_position or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def rotary_dim(config: ModelConfig) -> int:
    """Leading dims of each head that rotate: the whole head unless the config makes it partial."""
    return config.rotary_dim or config.head_dim


def inv_freq_and_scaling(config: ModelConfig) -> tuple[torch.Tensor, float]:
    rope, dim = config.rope, rotary_dim(config)
    if rope.kind == "yarn":
        return _yarn(rope, dim, config.max_position)
    inv_freq = _default_inv_freq(rope.theta, dim)
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    return inv_freq, 1.0


def rotary_table(config: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (length, rotary_dim) in fp32, for positions 0..length-1."""
    inv_freq, scaling = inv_freq_and_scaling(config)
    positions = torch.arange(length, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, L, D); cos/sin (B, 1, L, R) already in x's dtype, R <= D: the leading R dims of
    each head rotate (half-split layout within them), the other D - R pass through unchanged."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_and_rotate(x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Queries or keys x (B, L, heads, D): the per-head q/k norm (`norm`: an RMSNorm over head_dim,
    or None), then rotary; returns (B, L, heads, D). On CUDA both run as one fused launch."""
    if kernels.fused_ops_enabled(x) and (norm is None or norm.fused_scale is not None):
        if norm is None:
            return kernels.norm_rope(x, None, 0.0, kernels.SCALE_NONE, cos, sin)
        return kernels.norm_rope(x, norm.weight, norm.eps, norm.fused_scale, cos, sin)
    if norm is not None:
        x = norm(x)
    return apply_rotary(x.transpose(1, 2), cos, sin).transpose(1, 2)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: x (..., R) rotates as pairs (x0, x1), (x2, x3), … each by one frequency;
    cos/sin (..., R) as the table holds them (cat(freqs, freqs): the first half is per pair).

    The result is de-interleaved (all first members, then all second members), as transformers'
    apply_rotary_pos_emb_interleave returns it. DeepSeek-V2's complex form keeps the pairs in
    place instead; queries and keys share one permutation either way, so every q·k is the same."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
