"""The MoE block: router on the device, routed experts through the bank, optional shared expert.

The block owns only the always-resident tensors (router, shared expert); routed expert weights
live in the ExpertBank, which maps expert ids to slots and runs one fused dispatch per layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.mlp import SwiGLU

if TYPE_CHECKING:
    from moestream.experts.bank import ExpertBank


def route(logits: torch.Tensor, top_k: int, kind: str, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights (T, k) in fp32 and expert ids (T, k) from router logits (T, E)."""
    if kind == "topk_softmax":
        values, ids = torch.topk(logits.float(), top_k, dim=-1)
        return values.softmax(dim=-1), ids
    probs = logits.float().softmax(dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.top_k, self.router_kind, self.renormalise = config.top_k, spec.router, config.norm_topk_prob
        # Named as on disk, so the loader maps parameter names to checkpoint names one to one.
        self._router_name = spec.router_name
        self.add_module(spec.router_name, nn.Linear(config.hidden_size, config.num_experts, bias=False))
        self.shared_expert = SwiGLU(config.hidden_size, config.shared_intermediate) if spec.shared_expert else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if spec.shared_expert_gate else None
        self.bank: ExpertBank | None = None  # attached by the loader; not a submodule (it is not a parameter set)
        # Benchmark-only: a callable (layer, router logits) -> (weights, ids) that replaces the
        # model's own expert choice (synthetic or replayed routing); None in normal use.
        self.routing_override = None
        # Optional callable (layer, expert ids (T, k) on the device) that watches routing (profiles,
        # traces, discovery); it must not read the ids back itself during a captured step.
        self.routing_observer = None
        self.skip_routed = False  # router-only discovery: route, but run no routed expert

    @property
    def router(self) -> nn.Linear:
        return getattr(self, self._router_name)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids for tokens h (T, H)."""
        if self.routing_override is not None:
            weights, ids = self.routing_override(self.layer, self.router(h))
        else:
            weights, ids = route(self.router(h), self.top_k, self.router_kind, self.renormalise)
        if self.routing_observer is not None:
            self.routing_observer(self.layer, ids)
        return weights, ids

    def combine(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, resident: bool = False) -> torch.Tensor:
        """Routed experts (+ the shared expert) for routed tokens. `resident`: the caller made sure
        every routed expert is in the bank, so dispatch reads nothing back (graph-capturable)."""
        if self.skip_routed:
            out = torch.zeros_like(h)
        elif resident:
            out = self.bank.dispatch(self.layer, h, ids, weights)
        else:
            out = self.bank.forward(self.layer, h, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(h)) * shared
            out = out + shared
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, ids = self.route(h)
        return self.combine(h, ids, weights).view(shape)
