"""Gated full attention (Qwen3-Next's full-attention layers): GQA whose output is gated per channel.

q_proj is twice as wide as the heads: per head it yields the query (first head_dim) and an output
gate (second head_dim), interleaved head by head as transformers splits them. Queries and keys get
a per-head RMSNorm of the family's norm kind (zero-centred for Qwen3-Next), rotary applies to the
leading rotary_dim of each head (partial rotary: the table is that narrow), and the attention
output is multiplied by sigmoid(gate) before o_proj. The cache is the plain KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.cache import FullKVMixer, rotate_and_attend
from moestream.model.context import ForwardContext
from moestream.model.norms import NORMS
from moestream.model.projections import FusedQKV, Linear


class GatedAttention(FusedQKV, FullKVMixer, nn.Module):
    """A mixer (see `model.attention.MIXERS`): `prefix` is its checkpoint name."""

    prefix = "self_attn"

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        if spec.qk_norm not in ("none", "per_head"):
            raise ValueError(f"gated attention has no {spec.qk_norm!r} q/k norm")
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        H, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(H, 2 * q_dim, bias=config.qkv_bias)   # query and gate, per head
        self.k_proj = Linear(H, kv_dim, bias=config.qkv_bias)
        self.v_proj = Linear(H, kv_dim, bias=config.qkv_bias)
        self.o_proj = Linear(q_dim, H, bias=config.o_bias)
        self.qk_norm = spec.qk_norm == "per_head"
        if self.qk_norm:
            norm = NORMS[spec.norm]
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.project_qkv(x)
        q, gate = q.view(B, L, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, L, self.heads * self.head_dim)
        k = k.view(B, L, self.kv_heads, self.head_dim)
        v = v.view(B, L, self.kv_heads, self.head_dim)
        out = rotate_and_attend(ctx, self.layer, q, k, v, self.q_norm if self.qk_norm else None,
                                self.k_norm if self.qk_norm else None)
        out = out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim) * torch.sigmoid(gate)
        return self.o_proj(out)
