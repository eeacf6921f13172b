"""The decoder stack shared by every family; parameter names match the checkpoint's names.

A layer is a mixer (the ArchSpec names its kind in `MIXERS`, per layer where config.json mixes
kinds, as Qwen3-Next's Gated DeltaNet and gated attention) and a feed-forward part (an MoE
block, or a dense SwiGLU for the layers config.json keeps dense). A family whose layers are
wired differently names another kind of `LAYERS` (Gemma 4: model/gemma4_layer.py); the ArchSpec
also says whether embeddings are scaled (`embed_scale`) and config.json whether the logits are
soft-capped (`final_logit_softcap`).
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.attention import MIXERS
from moestream.model.cache import BlockTables, ModelCache
from moestream.model.context import ForwardContext
from moestream.model.embedding import Embedding
from moestream.model.gemma4_layer import Gemma4DecoderLayer, ScaledEmbedding
from moestream.model.mlp import SwiGLU
from moestream.model.moe import MoEBlock, RoutedExperts
from moestream.model.norms import NORMS
from moestream.model.projections import Linear
from moestream.sizes import dtype_size


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        mixer = MIXERS[spec.mixer_of(config, layer)]
        self._mixer_name = mixer.prefix
        self.add_module(mixer.prefix, mixer(config, spec, layer))
        self.input_layernorm = NORMS[spec.norm](config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = NORMS[spec.norm](config.hidden_size, config.rms_norm_eps)
        if config.moe_layers[layer]:
            self._ffn_name = spec.moe_prefix
            self.add_module(spec.moe_prefix, MoEBlock(config, spec, layer))
        else:
            self._ffn_name = "mlp"
            self.add_module("mlp", SwiGLU(config.hidden_size, config.dense_intermediate))

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self._mixer_name)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self._ffn_name)

    def attend_and_norm(self, x: torch.Tensor, ctx: ForwardContext,
                        delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """s + mixer(norm(s)) for the layer's input s = x + delta, and that sum's post-attention norm
        (the feed-forward input). `delta` is the previous layer's feed-forward output, not yet added:
        its add is the first norm's, one launch where fused."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, delta)
        return self.post_attention_layernorm.add_and_norm(x, self.mixer(h, ctx))

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on x + delta; returns (residual stream, feed-forward output), whose sum is the
        layer's output: the next layer (or the final norm) adds them in its own norm's launch."""
        x, h = self.attend_and_norm(x, ctx, delta)
        return x, self.ffn(h)


# Layer kinds an ArchSpec may name (`ArchSpec.layer`).
LAYERS: dict[str, type[nn.Module]] = {"standard": DecoderLayer, "gemma4": Gemma4DecoderLayer}
# What `moe_blocks` returns: the MoE blocks, and layers that are their own MoE block (Gemma 4).
MOE_BLOCKS = (MoEBlock, Gemma4DecoderLayer)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec):
        super().__init__()
        embedding = ScaledEmbedding if spec.embed_scale else Embedding
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        layer = LAYERS[spec.layer]
        self.layers = nn.ModuleList(layer(config, spec, i) for i in range(config.num_layers))
        self.norm = NORMS[spec.norm](config.hidden_size, config.rms_norm_eps)


class MoECausalLM(nn.Module):
    """Embeddings → decoder layers → norm → LM head. `forward` returns logits for the positions asked."""

    def __init__(self, config: ModelConfig, spec: ArchSpec):
        super().__init__()
        self.config = config
        self.model = Backbone(config, spec.resolved(config))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.ffn for layer in self.model.layers if isinstance(layer.ffn, MOE_BLOCKS)]

    @property
    def splits_at_routers(self) -> bool:
        """Every MoE layer is an `MoEBlock`, which segmented decode cuts between its router and its
        experts; Gemma 4's layer is its own block, run whole, so its fetch cannot sit between segments."""
        return all(isinstance(block, MoEBlock) for block in self.moe_blocks())

    def fuse_projections(self) -> None:
        """One GEMM for q, k and v in every mixer that has them (model/projections.py); once, after loading."""
        for layer in self.model.layers:
            fuse = getattr(layer.mixer, "fuse_qkv", None)
            if fuse is not None:
                fuse()

    def attach_experts(self, experts: RoutedExperts) -> None:
        """Every MoE block reaches its routed experts through `experts` from now on."""
        for block in self.moe_blocks():
            block.experts = experts

    def new_cache(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> ModelCache:
        """One cache per layer, of the kind its mixer needs."""
        layers = [layer.mixer.make_cache(self.config, rows, max_len, dtype, device) for layer in self.model.layers]
        return ModelCache(layers, rows, max_len, device)

    def new_paged_cache(self, rows: int, max_len: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                        device: torch.device, like: ModelCache | None = None) -> ModelCache:
        """Paged layers over one block table of `rows` rows; `like` (a paged cache) lends its pools,
        whose blocks keep what they hold, and its first rows' tables (the cache grew)."""
        tables = BlockTables(rows, max_len, block_size, device)
        if like is not None:
            tables.copy_rows_from(like.tables, min(like.rows, rows))
        layers = [layer.mixer.make_paged_cache(self.config, tables, num_blocks, dtype, device,
                                               pool=(like[i].k, like[i].v) if like is not None else None)
                  for i, layer in enumerate(self.model.layers)]
        return ModelCache(layers, rows, max_len, device, tables)

    def head(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the residual stream x + delta (delta: the last layer's pending output, or None)."""
        h = self.model.norm(x) if delta is None else self.model.norm.add_and_norm(x, delta)[1]
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcap
        if cap is not None:   # Gemma: cap * tanh(logits / cap), as transformers computes it
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, last_only: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, V); with `last_only` the last position's (B, 1, V); with `last` (a device index
        (1,)) that position's: a padded prompt chunk's last real token, chosen without the host."""
        x, delta = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, delta = layer(x, ctx, delta)
        if last_only:
            x, delta = x[:, -1:], (delta[:, -1:] if delta is not None else None)
        elif last is not None:
            x, delta = x.index_select(1, last), (delta.index_select(1, last) if delta is not None else None)
        return self.head(x, delta)

    @property
    def packs_prompts(self) -> bool:
        """Whether `forward_packed` can run: every layer splits its mixer from its feed-forward part
        (`DecoderLayer`); Gemma 4's layers run their MoE inside themselves."""
        return all(isinstance(layer, DecoderLayer) for layer in self.model.layers)

    def forward_packed(self, parts: list[tuple[torch.Tensor, ForwardContext]]) -> torch.Tensor:
        """Several sequences' prompt chunks in one pass: each part's ids (1, L_i) attend in their own
        context (their own cache row and positions), and each layer's feed-forward part runs once over
        every part's tokens, so an MoE layer routes them together and a bounded bank brings each
        missing expert in once for all of them, not once per sequence. Returns the logits of each
        part's last position (n, V)."""
        xs = [self.model.embed_tokens(ids) for ids, _ in parts]
        lengths = [x.shape[1] for x in xs]
        deltas: list[torch.Tensor | None] = [None] * len(parts)
        for layer in self.model.layers:
            normed = []
            for i, (_, ctx) in enumerate(parts):
                xs[i], h = layer.attend_and_norm(xs[i], ctx, deltas[i])
                normed.append(h)
            deltas = list(layer.ffn(torch.cat(normed, dim=1)).split(lengths, dim=1))
        x = torch.cat([x[:, -1:] for x in xs])
        delta = torch.cat([d[:, -1:] for d in deltas])
        return self.head(x, delta)[:, -1]


def pageable(config: ModelConfig, spec: ArchSpec) -> bool:
    """Whether every layer keeps full-context keys and values, so the whole cache can be paged."""
    return all(getattr(MIXERS[spec.mixer_of(config, layer)], "pageable", False) for layer in range(config.num_layers))


def block_bytes(config: ModelConfig, spec: ArchSpec, block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of one paged block across every layer."""
    return sum(MIXERS[spec.mixer_of(config, layer)].block_bytes(config, block_size, dtype)
               for layer in range(config.num_layers))


def attention_workspace_bytes(config: ModelConfig, spec: ArchSpec, tokens: int, max_len: int,
                              dtype: torch.dtype) -> int:
    """What a forward of `tokens` rows (a prompt chunk, or a decode batch's one row each) holds to attend
    to up to `max_len` positions, beyond q, k, v and the output: its mask (bool) and additive bias (the
    compute dtype), one of each for the whole forward (`ForwardContext`), and the most scores one
    layer's mixer holds at a time (`score_bytes`: none for SDPA)."""
    if tokens <= 1:
        return 0
    mask = tokens * max_len * (1 + dtype_size(dtype))
    return mask + max(getattr(MIXERS[spec.mixer_of(config, layer)], "score_bytes", _no_scores)(config, tokens, max_len,
                                                                                               dtype)
                      for layer in range(config.num_layers))


def _no_scores(config: ModelConfig, tokens: int, attended: int, dtype: torch.dtype) -> int:
    return 0   # a mixer without softmax attention (linear attention's recurrence)


def cache_bytes(config: ModelConfig, spec: ArchSpec, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """What `MoECausalLM.new_cache` allocates, from the config alone (the memory plan)."""
    return sum(MIXERS[spec.mixer_of(config, layer)].cache_bytes(config, rows, max_len, dtype)
               for layer in range(config.num_layers))


def parameter_dtype(module: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter is loaded (and converted) in: the compute dtype, except the ones a module
    keeps in fp32 (`full_precision`, e.g. a router's selection bias, whose small differences decide
    near-ties between experts)."""
    return torch.float32 if name in getattr(module, "full_precision", ()) else dtype
