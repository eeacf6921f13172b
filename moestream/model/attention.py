"""GQA attention with optional q/k RMSNorm (per head or over the full projection) on torch SDPA."""

from __future__ import annotations

import torch
from torch import nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.cache import FullKVMixer, rotate_and_attend
from moestream.model.context import ForwardContext
from moestream.model.gated_attention import GatedAttention
from moestream.model.gemma4_attention import Gemma4Attention, Gemma4SlidingAttention
from moestream.model.linear_attention import GatedDeltaNet
from moestream.model.mla import MultiLatentAttention
from moestream.model.norms import RMSNorm
from moestream.model.projections import FusedQKV, Linear
from moestream.model.sink_attention import SinkAttention, SlidingSinkAttention


class Attention(FusedQKV, FullKVMixer, nn.Module):
    """A mixer: `prefix` is its name in the checkpoint, `make_cache` / `cache_bytes` its cache kind."""

    prefix = "self_attn"

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        H, q_dim, kv_dim = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(H, q_dim, bias=config.qkv_bias)
        self.k_proj = Linear(H, kv_dim, bias=config.qkv_bias)
        self.v_proj = Linear(H, kv_dim, bias=config.qkv_bias)
        self.o_proj = Linear(q_dim, H, bias=config.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "per_head":
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(kv_dim, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, L, self.heads, self.head_dim)
        k = k.view(B, L, self.kv_heads, self.head_dim)
        v = v.view(B, L, self.kv_heads, self.head_dim)
        per_head = self.qk_norm == "per_head"
        out = rotate_and_attend(ctx, self.layer, q, k, v, self.q_norm if per_head else None,
                                self.k_norm if per_head else None)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))


# Mixer kinds an ArchSpec may name (`ArchSpec.mixer`, or per layer `ArchSpec.layer_mixers`): the
# token-mixing half of a decoder layer (MLA: model/mla.py; GPT-OSS's sink attention, full and sliding
# window: model/sink_attention.py; Gemma 4's normed, scale-1 attention, full and sliding window:
# model/gemma4_attention.py).
MIXERS: dict[str, type[nn.Module]] = {"gqa": Attention, "gated_gqa": GatedAttention, "gated_deltanet": GatedDeltaNet,
                                      "mla": MultiLatentAttention, "sink_gqa": SinkAttention,
                                      "sink_swa": SlidingSinkAttention, "gemma_gqa": Gemma4Attention,
                                      "gemma_swa": Gemma4SlidingAttention}
