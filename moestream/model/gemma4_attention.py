"""Gemma 4's attention: sliding-window layers and full ("global") layers that differ in shape.

Both kinds normalise queries and keys per head (`GemmaRMSNorm`, weighted) and values per head
without a weight, rotate queries and keys, and attend with a softmax scale of 1 (the norms set the
scale), as transformers' Gemma4TextAttention does; there is no attention-logit soft-capping.

Sliding layers (`gemma_swa`) use ModelConfig's head_dim, key/value heads and rotary: the runtime's
shared cos/sin table. Position q attends to keys q - window < kv <= q, through a `RingKVCache` of
`window` positions (the context when shorter), read before the step's own keys are written, as
GPT-OSS's sliding layers do (model/sink_attention.py).

Full layers (`gemma_gqa`) use `ModelConfig.global_attention`: wider heads, their own key/value head
count, and, where `k_eq_v`, no v_proj (the values are the key projection before k_norm). Their rotary
is not the shared table: transformers' proportional rope keeps head_dim / 2 frequencies of which
only the leading `rotary_fraction` are non-zero (computed with the full head_dim in the exponent),
so every dim goes through rotate_half but most rotate by zero. Their cos/sin are computed per call
from the step's positions and this layer's inverse frequencies (fp32 product, as transformers
does), on the device, with no value read back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, GlobalAttentionConfig, ModelConfig
from moestream.model.cache import KVCache, SlidingWindowMixer, attended_keys_values
from moestream.model.context import ForwardContext
from moestream.model.norms import GemmaRMSNorm, UnscaledRMSNorm
from moestream.model.projections import Linear
from moestream.model.rotary import apply_rotary


def proportional_inv_freq(theta: float, head_dim: int, fraction: float, factor: float = 1.0) -> Tensor:
    """transformers' proportional rope: int(fraction * head_dim // 2) frequencies theta^(-2i/head_dim),
    then zeros up to head_dim / 2, all divided by `factor`. Built on the CPU in fp32."""
    angles = int(fraction * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = torch.cat((1.0 / (theta ** exponents), torch.zeros(head_dim // 2 - angles, device="cpu")))
    return inv_freq / factor


class Gemma4Attention(nn.Module):
    """A full-attention mixer (see `model.attention.MIXERS`): the full KV cache of its own shape."""

    prefix = "self_attn"

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.heads = config.num_heads
        self.kv_heads, self.head_dim, k_eq_v = self.shape(config)
        H, D = config.hidden_size, self.head_dim
        self.q_proj = Linear(H, self.heads * D, bias=config.qkv_bias)
        self.k_proj = Linear(H, self.kv_heads * D, bias=config.qkv_bias)
        self.v_proj = None if k_eq_v else Linear(H, self.kv_heads * D, bias=config.qkv_bias)
        self.o_proj = Linear(self.heads * D, H, bias=config.o_bias)
        self.q_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(D, config.rms_norm_eps)
        self.v_norm = UnscaledRMSNorm(config.rms_norm_eps)
        self._inv_freq = self.inv_freq(config)          # CPU fp32, or None: the shared table
        self._inv_freq_on: dict[torch.device, Tensor] = {}

    @staticmethod
    def _global(config: ModelConfig) -> GlobalAttentionConfig:
        g = config.global_attention
        if g is None:
            raise ValueError("a gemma_gqa layer needs ModelConfig.global_attention (archs/config.py sets it)")
        return g

    @classmethod
    def shape(cls, config: ModelConfig) -> tuple[int, int, bool]:
        """(key/value heads, head_dim, values = keys) of this kind of layer."""
        g = cls._global(config)
        return g.kv_heads, g.head_dim, g.k_eq_v

    @classmethod
    def inv_freq(cls, config: ModelConfig) -> Tensor | None:
        g = cls._global(config)
        return proportional_inv_freq(g.rope.theta, g.head_dim, g.rotary_fraction, g.rope.factor)

    @classmethod
    def cache_bytes(cls, config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype) -> int:
        kv_heads, head_dim, _ = cls.shape(config)
        return rows * max_len * KVCache.bytes_per_token(kv_heads, head_dim, dtype)

    @classmethod
    def make_cache(cls, config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> KVCache:
        kv_heads, head_dim, _ = cls.shape(config)
        return KVCache(rows, max_len, kv_heads, head_dim, dtype, device)

    def rotary(self, ctx: ForwardContext, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (B, 1, L, head_dim) in `dtype` for the step's positions."""
        if self._inv_freq is None:
            return ctx.cos, ctx.sin
        device = ctx.positions.device
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:   # once per device, in the first (eager) call: never inside a capture
            inv_freq = self._inv_freq_on[device] = self._inv_freq.to(device)
        freqs = ctx.positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def project(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor, Tensor]:
        """Normalised, rotated queries (B, heads, L, D) and keys (B, L, kv_heads, D); normalised
        values (B, L, kv_heads, D)."""
        B, L, _ = x.shape
        cos, sin = self.rotary(ctx, x.dtype)
        q = self.q_norm(self.q_proj(x).view(B, L, self.heads, self.head_dim))
        k = self.k_proj(x).view(B, L, self.kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(B, L, self.kv_heads, self.head_dim)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin).transpose(1, 2)
        return q, k, self.v_norm(v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """SDPA with scale 1 over k, v (B, kv_heads, S, D); the output projected (B, L, H)."""
        B, _, L, _ = q.shape
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.project(x, ctx)
        k, v = attended_keys_values(ctx, self.layer, k, v)
        return self.attend(q, k, v, ctx.mask)


class Gemma4SlidingAttention(SlidingWindowMixer, Gemma4Attention):
    """A sliding-window mixer: ModelConfig's own heads and rotary, a `RingKVCache` of the window."""

    @classmethod
    def shape(cls, config: ModelConfig) -> tuple[int, int, bool]:
        return config.num_kv_heads, config.head_dim, False

    @classmethod
    def inv_freq(cls, config: ModelConfig) -> Tensor | None:
        return None

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__(config, spec, layer)
        self.window = config.sliding_window

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.project(x, ctx)
        return self.sliding_attend(ctx, k, v, lambda keys, values, mask: self.attend(q, keys, values, mask))
