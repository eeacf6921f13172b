"""Gemma 4's decoder layer (`ArchSpec.layer = "gemma4"`), its dense GeGLU MLP and scaled embedding.

A Gemma 4 MoE layer, as transformers' Gemma4TextDecoderLayer computes it:

    x = x + post_attention_layernorm(attn(input_layernorm(x)))          # sandwich-normed attention
    dense  = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
    w, ids = router(x)                                                   # the residual, not a norm's output
    routed = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x), ids, w))
    x = (x + post_feedforward_layernorm(dense + routed)) * layer_scalar

Every layer has both the dense MLP (intermediate_size, GeGLU with tanh gelu) and the routed experts
(moe_intermediate_size, the same activation), each with its own norms. The layer is its own MoE
block: it answers the calls the engine makes of one (`layer`, `router`, `swap_router`, `route`,
`experts`), with the router and norms registered under their on-disk names
(`model.layers.N.router.*`, `...pre_feedforward_layernorm_2.weight`, `...layer_scalar`).

It is deliberately not an `MoEBlock`: the runtime's segmented decode (runtime/cuda_graphs.py)
splits a layer as `x + combine(post_attention_layernorm(x))`, which does not describe this layer
(the router reads the raw residual, the output is normed and scaled as a whole), so the runtime
runs it unsplit, the routed experts (fetching misses) inside `forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.attention import MIXERS
from moestream.model.context import ForwardContext
from moestream.model.embedding import Embedding
from moestream.model.moe import RoutedExperts
from moestream.model.norms import GemmaRMSNorm
from moestream.model.projections import Linear
from moestream.model.routers import ROUTERS


class GeGLU(nn.Module):
    """Gemma's dense MLP: down(gelu_tanh(gate(x)) * up(x)) (hidden_activation gelu_pytorch_tanh)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class ScaledEmbedding(Embedding):
    """Embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first, as
    transformers' Gemma4TextScaledWordEmbedding does (in bf16 sqrt(2816) is 53.0, not 53.07).
    `embed_scale` is a plain float so that the meta-device build and quantize_modules keep it."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = embedding_dim ** 0.5

    def forward(self, ids: Tensor) -> Tensor:
        rows = super().forward(ids)
        return rows * _rounded(self.embed_scale, rows.dtype)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as `dtype` holds it (a host-side constant: nothing is read from the device)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(dtype).tolist()


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 MoE layer; `ffn` is the layer itself (its MoE block, see the module docstring)."""

    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        if not config.moe_layers[layer]:
            raise ValueError(f"layer {layer} is dense, but every Gemma 4 MoE layer has routed experts")
        H, eps = config.hidden_size, config.rms_norm_eps
        self.layer, self.top_k = layer, config.top_k
        mixer = MIXERS[spec.mixer_of(config, layer)]
        self._mixer_name = mixer.prefix
        self.add_module(mixer.prefix, mixer(config, spec, layer))
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.mlp = GeGLU(H, config.dense_intermediate)
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(H, eps)
        self.router = ROUTERS[spec.router](config)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(H, eps)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(H, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1))
        self.experts: RoutedExperts | None = None   # attached after loading (not a submodule: no parameters)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self._mixer_name)

    @property
    def ffn(self) -> "Gemma4DecoderLayer":
        """The layer's MoE block is the layer (router and norms live at layer level on disk)."""
        return self

    def swap_router(self, router: nn.Module) -> nn.Module:
        """Put another router in place (observed or benchmark routing); returns the one it replaces."""
        previous = self.router
        self.router = router
        return previous

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights (T, k) fp32 and expert ids (T, k) for residual-stream states h (T, H)."""
        return self.router(h)

    def attend(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        return x + self.post_attention_layernorm(self.mixer(self.input_layernorm(x), ctx))

    def forward(self, x: Tensor, ctx: ForwardContext, delta: Tensor | None = None) -> tuple[Tensor, None]:
        """The layer on x + delta (the decoder's layer protocol); its output comes back whole."""
        if delta is not None:
            x = x + delta
        x = self.attend(x, ctx)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        h = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(h)
        routed = self.experts.forward(self.layer, self.pre_feedforward_layernorm_2(h), ids, weights)
        routed = self.post_feedforward_layernorm_2(routed.view_as(x))
        return (x + self.post_feedforward_layernorm(dense + routed)) * self.layer_scalar, None
