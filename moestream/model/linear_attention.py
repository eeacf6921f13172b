"""Gated DeltaNet (Qwen3-Next's linear-attention layers): a fixed-size recurrent state instead of a KV cache.

Per token: in_proj_qkvz gives queries, keys, values and an output gate z; in_proj_ba gives the
write strength b and the decay input a. q, k and v go through a short causal depthwise conv
(its last K-1 inputs are state) and silu; then the gated delta rule (`kernels.delta_rule`: q and k
L2-normalised, q also scaled by 1/sqrt(Dk)) with beta = sigmoid(b) and log decay
g = -exp(A_log) · softplus(a + dt_bias) updates each value head's state and reads it with q. The
output is RMS-normalised per head, gated by silu(z), and projected back by out_proj.

The in-projections are read as the checkpoint stores them (`ArchSpec.linear_projections`):
Qwen3-Next lays them out per key head, for each key head [q (Dk), k (Dk), v (r·Dv), z (r·Dv)] and
[b (r), a (r)], r = value_heads // key_heads; Qwen3.5 stores in_proj_qkv, in_proj_z, in_proj_b and
in_proj_a separately, in plain head order. The conv's channels are all q heads, then all k
heads, then all v heads.

With a cache (`RecurrentCache`), a call continues each row from the state its cache row holds
(zeros at position 0) and stores the state after its tokens: a prompt may arrive in chunks,
across steps, and every row of a decode batch carries its own state whatever its length. Prefill
uses the chunked form, one-token steps the recurrent form; both are plain device work
(flash-linear-attention's kernels on CUDA in bf16/fp16 when installed, else the torch reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, LinearAttentionConfig, ModelConfig
from moestream.kernels.delta_rule import gated_delta_rule
from moestream.model.cache import RecurrentCache
from moestream.model.context import ForwardContext
from moestream.model.norms import GatedRMSNorm
from moestream.model.projections import Linear


def _shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv inputs kept per row, state per row) of one linear-attention layer."""
    lin = config.linear_attention
    channels = 2 * lin.key_heads * lin.key_dim + lin.value_heads * lin.value_dim
    return (lin.conv_kernel - 1, channels), (lin.value_heads, lin.key_dim, lin.value_dim)


class GatedDeltaNet(nn.Module):
    """A mixer (see `model.attention.MIXERS`): `prefix` is its checkpoint name."""

    prefix = "linear_attn"

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        lin: LinearAttentionConfig = config.linear_attention
        self.layer = layer
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = (
            lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim)
        self.group = lin.value_heads // lin.key_heads
        self.kernel = lin.conv_kernel
        key_width, value_width = lin.key_heads * lin.key_dim, lin.value_heads * lin.value_dim
        self.widths = [key_width, key_width, value_width]
        channels = sum(self.widths)
        H = config.hidden_size
        self.split = spec.linear_projections == "split"
        if self.split:
            self.in_proj_qkv = Linear(H, channels, bias=False)
            self.in_proj_z = Linear(H, value_width, bias=False)
            self.in_proj_b = Linear(H, lin.value_heads, bias=False)
            self.in_proj_a = Linear(H, lin.value_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(H, 2 * key_width + 2 * value_width, bias=False)
            self.in_proj_ba = Linear(H, 2 * lin.value_heads, bias=False)
        # A module for its checkpoint name (conv1d.weight, (channels, 1, K)); forward convolves the window
        # of cached and new inputs itself.
        self.conv1d = nn.Conv1d(channels, channels, lin.conv_kernel, groups=channels, bias=False,
                                padding=lin.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.empty(lin.value_heads))
        self.A_log = nn.Parameter(torch.empty(lin.value_heads))
        self.norm = GatedRMSNorm(lin.value_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_width, H, bias=False)

    @staticmethod
    def cache_bytes(config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype) -> int:
        """Fixed per row: the context length does not enter."""
        return rows * RecurrentCache.bytes_per_row(*_shapes(config), dtype)

    @staticmethod
    def make_cache(config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> RecurrentCache:
        return RecurrentCache(rows, *_shapes(config), dtype, device)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Conv input (B, L, channels), z (B, L, Hv, Dv), b and a (B, L, Hv), from either layout."""
        B, L, _ = x.shape
        r, Dk, Dv = self.group, self.key_dim, self.value_dim
        if self.split:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(B, L, self.value_heads, Dv),
                    self.in_proj_b(x), self.in_proj_a(x))
        qkvz = self.in_proj_qkvz(x).view(B, L, self.key_heads, 2 * Dk + 2 * r * Dv)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, L, self.key_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([t.reshape(B, L, -1) for t in (q, k, v)], dim=-1)
        Hv = self.value_heads
        return mixed, z.reshape(B, L, Hv, Dv), b.reshape(B, L, Hv), a.reshape(B, L, Hv)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        B, L, _ = x.shape
        if ctx.valid is not None:   # padding must not reach the state (left padding sits before real tokens)
            x = x * ctx.valid[..., None].to(x.dtype)
        mixed, z, b, a = self._project(x)
        cache: RecurrentCache | None = ctx.cache[self.layer] if ctx.cache is not None else None
        if cache is None:
            conv_in = mixed.new_zeros(B, self.kernel - 1, mixed.shape[-1])
            state = mixed.new_zeros(B, self.value_heads, self.key_dim, self.value_dim, dtype=torch.float32)
        else:
            rows = ctx.write_rows[:, 0]
            conv_in, state = cache.read(rows, ctx.positions[:, 0])
        window = torch.cat((conv_in, mixed), dim=1)                       # (B, K-1+L, channels)
        mixed = F.silu(F.conv1d(window.transpose(1, 2), self.conv1d.weight, groups=mixed.shape[-1])).transpose(1, 2)
        q, k, v = mixed.split(self.widths, dim=-1)
        q = q.reshape(B, L, self.key_heads, self.key_dim)
        k = k.reshape(B, L, self.key_heads, self.key_dim)
        v = v.reshape(B, L, self.value_heads, self.value_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, state = gated_delta_rule(q, k, v, g, beta, state)
        if cache is not None:
            cache.write(rows, ctx.positions[:, -1] + 1, window[:, window.shape[1] - (self.kernel - 1):], state)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, L, self.value_heads * self.value_dim))
