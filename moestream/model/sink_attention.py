"""GPT-OSS attention: GQA with biases on q/k/v/o and a learned sink logit per head, over every
position (full layers) or over a sliding window (sliding layers).

Sinks. Head h has a learned logit s_h that joins the softmax over its keys as one more column
whose value is zero: p_j = exp(score_j) / (sum_i exp(score_i) + exp(s_h)). The sink takes
probability mass from the keys and adds nothing to the output. SDPA has no such column, so
`sink_attention` computes the scores explicitly, with an fp32 softmax, as transformers' eager
GPT-OSS attention does (the reference this family is checked against). It works in blocks of
queries sized so that one block's fp32 scores stay bounded (a long prompt chunk against a long
context); shapes depend only on host-known sizes and nothing is read back, so decode captures
in CUDA graphs.

Sliding window. A sliding_attention layer lets position q attend to keys q - window < kv <= q
(transformers' sliding-window mask). Its cache is a `RingKVCache` of `window` positions (the
context when shorter), so its memory does not grow with the context: a step attends to the ring
as it was before the step (each slot's position computed from the step's first position) plus
its own keys, under a mask built from those positions, and then writes its last keys into the
ring. Without a cache (a whole padded batch), the window is applied to the positions directly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.cache import FullKVMixer, SlidingWindowMixer, attended_keys_values
from moestream.model.context import ForwardContext
from moestream.model.projections import FusedQKV, Linear
from moestream.model.rotary import norm_and_rotate
from moestream.sizes import dtype_size

# fp32 scores of one block of queries: at most this many elements (128 MiB; the softmax runs in
# place on them), so a prompt chunk against a long context does not hold (chunk x context x heads)
# scores at once. One query per row is the floor: a decode step holds rows x heads x context.
BLOCK_ELEMENTS = 1 << 25


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, scale: float,
                   block_elements: int = BLOCK_ELEMENTS) -> Tensor:
    """Attention whose softmax has one more column per head, the sink logit, with no value.

    q (B, Hq, L, D); k, v (B, Hkv, S, D) with Hkv dividing Hq: query head h reads key/value head
    h // (Hq / Hkv), as transformers' repeat_kv pairs them (without copying k and v); sinks (Hq,);
    mask (B or 1, 1, L, S) bool, True = attend, or None. Returns (B, Hq, L, D) in q's dtype.
    A query with every key masked gets zeros (all its mass goes to the sink), never NaN.
    """
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    block = max(1, min(L, block_elements // max(1, B * Hq * S)))
    sink = sinks.float().view(1, Hkv, G, 1, 1)
    keys_t = k.transpose(-1, -2)
    outs = []
    for first in range(0, L, block):
        qb = q[:, :, first:first + block]
        n = qb.shape[2]
        scores = torch.matmul(qb.reshape(B, Hkv, G * n, D), keys_t).float().view(B, Hkv, G, n, S).mul_(scale)
        if mask is not None:
            scores.masked_fill_(~mask[:, :, None, first:first + n], float("-inf"))
        # softmax over [scores, sink] in place, the sink's column never materialised
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        probs = scores.sub_(top).exp_()
        probs.div_(probs.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
        outs.append(torch.matmul(probs.to(v.dtype).view(B, Hkv, G * n, S), v).view(B, Hkv, G, n, D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(B, Hq, L, D).to(q.dtype)


class SinkAttention(FusedQKV, FullKVMixer, nn.Module):
    """A mixer (see `model.attention.MIXERS`) over every position: the full KV cache."""

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
        self.sinks = nn.Parameter(torch.empty(config.num_heads))
        self.scale = config.head_dim ** -0.5

    def project(self, x: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries (B, heads, L, D), rotated keys and values (B, L, kv_heads, D)."""
        B, L, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, L, self.heads, self.head_dim)
        k = k.view(B, L, self.kv_heads, self.head_dim)
        v = v.view(B, L, self.kv_heads, self.head_dim)
        q = norm_and_rotate(q, None, ctx.cos, ctx.sin).transpose(1, 2)
        k = norm_and_rotate(k, None, ctx.cos, ctx.sin)
        return q, k, v

    def output(self, out: Tensor) -> Tensor:
        B, _, L, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.head_dim))

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.project(x, ctx)
        k, v = attended_keys_values(ctx, self.layer, k, v)
        return self.output(sink_attention(q, k, v, self.sinks, ctx.mask, self.scale))

    @staticmethod
    def score_bytes(config: ModelConfig, tokens: int, attended: int, dtype: torch.dtype) -> int:
        """`sink_attention`'s block of scores: at most BLOCK_ELEMENTS of them, as the product in the
        compute dtype and again in fp32, and the block of the mask it reads."""
        rows = min(tokens, max(1, BLOCK_ELEMENTS // (config.num_heads * attended)))   # queries a block
        return rows * attended * (config.num_heads * (dtype_size(dtype) + 4) + 1)


class SlidingSinkAttention(SlidingWindowMixer, SinkAttention):
    """A mixer over the last `sliding_window` positions: a `RingKVCache` of that many positions."""

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__(config, spec, layer)
        self.window = config.sliding_window

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        q, k, v = self.project(x, ctx)
        return self.output(self.sliding_attend(
            ctx, k, v, lambda keys, values, mask: sink_attention(q, keys, values, self.sinks, mask, self.scale)))
