"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash), caching the latent, not K/V.

Per token: the query comes from q_proj, or through a low-rank bottleneck (q_a_proj → RMSNorm →
q_b_proj) when q_lora_rank is set; each head's query is qk_nope dims without position and
qk_rope dims with rotary. kv_a_proj_with_mqa yields the compressed kv (kv_lora_rank, then
RMSNorm) and one rope key (qk_rope dims) shared by every head; kv_b_proj expands the compressed
kv into each head's qk_nope key dims and v_head_dim value dims. The rope parts rotate as adjacent
pairs (`rope_interleave`, DeepSeek's layout; DeepSeek-V2 always) or half-split. The softmax scale
is 1/sqrt(qk_nope + qk_rope), sharpened by yarn's mscale² when the rope is scaled (computed once
by the config reader, as transformers does).

The cache (`LatentCache`) keeps only the normalised compressed kv and the rotated rope key per
position: (kv_lora_rank + qk_rope) values per token and layer, against 2 × heads × head_dim for
K/V. Two ways to attend over it, the same numbers in exact arithmetic:

  expanded (default)  kv_b_proj up-projects every cached position to per-head K and V each call,
                      then plain attention. Simple; its transient K/V grow with the context.
  absorbed            W_UK folds into the query (q_nope · W_UK per head: a query in latent space),
                      attention runs against the cached latent itself, read in place (keys =
                      [kv | rope key], values = kv, one key shared by all heads: batched matrix
                      products over heads × queries), and W_UV maps the result out per head.
                      Nothing per position is expanded. Set `absorbed` on the module (or
                      `set_absorbed`). Plain torch so far: its scores are heads × queries × context,
                      fine for decode, large for long prefill chunks (a fused kernel is for later).

Both are device work with host-known shapes only (no value is read back), so decode captures in
CUDA graphs; the choice is a Python attribute fixed at capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, LatentAttentionConfig, ModelConfig
from moestream.model.cache import LatentCache
from moestream.model.context import ForwardContext
from moestream.model.norms import NORMS
from moestream.model.projections import Linear
from moestream.model.rotary import apply_rotary, apply_rotary_interleaved
from moestream.quant import dequantize
from moestream.sizes import dtype_size

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm's default eps, not the
# config's rms_norm_eps (GLM-4.7-Flash's 1e-5 applies to the layer norms only).
LATENT_NORM_EPS = 1e-6


class MultiLatentAttention(nn.Module):
    """A mixer (see `model.attention.MIXERS`): `prefix` is its checkpoint name."""

    prefix = "self_attn"
    absorbed = False   # attend in latent space (see the module docstring); per instance

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        mla: LatentAttentionConfig = config.latent_attention
        self.layer = layer
        self.heads = config.num_heads
        self.rank, self.nope, self.rope, self.v_dim = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                       mla.v_head_dim)
        self.scale = mla.softmax_scale
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        H, qk, norm = config.hidden_size, mla.qk_nope_head_dim + mla.qk_rope_head_dim, NORMS[spec.norm]
        self.low_rank_q = mla.q_lora_rank is not None
        if self.low_rank_q:
            self.q_a_proj = Linear(H, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = norm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, self.heads * qk, bias=False)
        else:
            self.q_proj = Linear(H, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(H, self.rank + self.rope, bias=config.qkv_bias)
        self.kv_a_layernorm = norm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.heads * self.v_dim, H, bias=config.o_bias)

    @staticmethod
    def cache_bytes(config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype) -> int:
        mla = config.latent_attention
        return rows * max_len * LatentCache.bytes_per_token(mla.kv_lora_rank, mla.qk_rope_head_dim, dtype)

    @staticmethod
    def score_bytes(config: ModelConfig, tokens: int, attended: int, dtype: torch.dtype) -> int:
        """The larger of the two forms (`mla_absorbed` is a runtime choice): the expanded one
        up-projects every attended position to per-head keys and values (SDPA then keeps no scores);
        the latent one holds every score, in the compute dtype, in fp32 for the softmax, and as
        probabilities."""
        mla, e = config.latent_attention, dtype_size(dtype)
        expanded = attended * config.num_heads * (2 * mla.qk_nope_head_dim + mla.qk_rope_head_dim
                                                  + mla.v_head_dim) * e   # kv_b_proj's output, then k
        latent = tokens * config.num_heads * attended * (2 * e + 4)
        return max(expanded, latent)

    @staticmethod
    def make_cache(config: ModelConfig, rows: int, max_len: int, dtype: torch.dtype,
                   device: torch.device) -> LatentCache:
        mla = config.latent_attention
        return LatentCache(rows, max_len, mla.kv_lora_rank, mla.qk_rope_head_dim, dtype, device)

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        B, L, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q_nope, q_rope = q.view(B, L, self.heads, self.nope + self.rope).transpose(1, 2).split(
            [self.nope, self.rope], dim=-1)
        kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_rope = self.rotate(q_rope, ctx.cos, ctx.sin)                  # (B, heads, L, rope)
        k_rope = self.rotate(k_rope[:, None], ctx.cos, ctx.sin)[:, 0]  # (B, L, rope): one key for all heads
        latent = torch.cat((self.kv_a_layernorm(kv), k_rope), dim=-1)  # (B, L, rank + rope): what the cache keeps
        if ctx.cache is not None:
            cache: LatentCache = ctx.cache[self.layer]
            cache.write(ctx.write_rows, ctx.positions, latent)
            latent = cache.read(ctx.cache_rows, ctx.kv_len)            # (B, S, rank + rope), a view
        attend = self._absorbed if self.absorbed else self._expanded
        out = attend(q_nope, q_rope, latent, ctx.mask)                 # (B, heads, L, v_dim)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.heads * self.v_dim))

    def _expanded(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, mask: Tensor | None) -> Tensor:
        """Up-project every attended position to per-head keys and values, then attend."""
        B, S, _ = latent.shape
        kv, k_rope = latent.split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(kv).view(B, S, self.heads, self.nope + self.v_dim).transpose(1, 2).split(
            [self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(B, self.heads, S, self.rope)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, mask: Tensor | None) -> Tensor:
        """Attend in latent space: the query q_nope·W_UK (+ its rope part) against the latent itself as the
        key and its compressed kv as the value, one key for every head, so that batched matrix products
        over (heads × queries) read the cache in place; the output leaves through W_UV."""
        B, H, L, _ = q_nope.shape
        S = latent.shape[1]
        w = self.kv_b_weight(q_nope.dtype).view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]                  # (heads, nope, rank), (heads, v, rank)
        q = torch.cat((torch.einsum("bhln,hnr->bhlr", q_nope, w_uk), q_rope), dim=-1)
        scores = torch.bmm(q.reshape(B, H * L, self.rank + self.rope), latent.transpose(1, 2)).view(B, H, L, S)
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.float().softmax(dim=-1).to(latent.dtype)
        out = torch.bmm(probs.view(B, H * L, S), latent[..., :self.rank]).view(B, H, L, self.rank)
        return torch.einsum("bhlr,hvr->bhlv", out, w_uv)

    def kv_b_weight(self, dtype: torch.dtype) -> Tensor:
        """kv_b_proj's (heads·(nope + v), rank) weight: as stored, or dequantized where the precision
        plan made it a QuantLinear."""
        proj = self.kv_b_proj
        if isinstance(proj, nn.Linear):
            return proj.weight
        return dequantize(proj.qweight, proj.scales, proj.biases, proj.spec, dtype)


def set_absorbed(model: nn.Module, absorbed: bool = True) -> int:
    """Switch every MLA layer of `model` to the absorbed (or expanded) form; returns how many.
    Capture decode graphs after switching: a graph keeps the form it was captured with."""
    layers = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
    for m in layers:
        m.absorbed = absorbed
    return len(layers)
