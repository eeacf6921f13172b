"""The MoE block: router on the device, routed experts through a small protocol, optional shared expert(s).

The block owns only the always-resident tensors (router, shared expert). Routed expert weights
live elsewhere, behind `RoutedExperts`: the engine's bank implements it (slots on the device,
misses fetched or skipped), and so can anything else that turns routed ids into outputs
(router-only discovery attaches one that computes nothing). `model/` never imports the bank.
"""

from __future__ import annotations

from typing import Protocol

import torch.nn.functional as F
from torch import Tensor, nn

from moestream.archs.spec import ArchSpec, ModelConfig
from moestream.model.mlp import SwiGLU
from moestream.model.projections import Linear
from moestream.model.routers import ROUTERS


class RoutedExperts(Protocol):
    """What an MoE block needs from whoever holds the routed experts of every layer."""

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t]) for hidden (T, H); may bring missing
        experts in first (and read the routing back to do so)."""

    def dispatch(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """The same, when the caller has made sure every routed expert is resident: device work only
        (capturable in a CUDA graph)."""


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, spec: ArchSpec, layer: int):
        super().__init__()
        self.layer = layer
        self.top_k = config.top_k
        # Named as on disk, so the loader maps parameter names to checkpoint names one to one.
        self._router_name = spec.router_name
        self.add_module(spec.router_name, ROUTERS[spec.router](config))
        # The shared expert too is named as on disk (`shared_expert` in Qwen2-MoE, `shared_experts` in GLM).
        self._shared_name = spec.shared_expert_name if spec.shared_expert else None
        if self._shared_name is not None:
            self.add_module(self._shared_name, SwiGLU(config.hidden_size, config.shared_intermediate))
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if spec.shared_expert_gate else None
        self.experts: RoutedExperts | None = None   # attached after loading (not a submodule: no parameters)

    @property
    def shared(self) -> nn.Module | None:
        """The shared expert(s): one SwiGLU every token goes through beside the routed experts."""
        return getattr(self, self._shared_name) if self._shared_name is not None else None

    @property
    def router(self) -> nn.Module:
        # Read from the registered modules, not by attribute: a router stored as `router` (GPT-OSS)
        # would find this property again. Missing (during registration) is an AttributeError, as
        # `nn.Module.add_module` expects of an attribute that is not there yet.
        try:
            return self._modules[self._router_name]
        except KeyError:
            raise AttributeError(self._router_name) from None

    def swap_router(self, router: nn.Module) -> nn.Module:
        """Put another router in place (observed or benchmark routing); returns the one it replaces."""
        previous = self.router
        setattr(self, self._router_name, router)
        return previous

    def route(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights (T, k) fp32 and expert ids (T, k) for tokens h (T, H)."""
        return self.router(h)

    def combine(self, h: Tensor, ids: Tensor, weights: Tensor, resident: bool = False) -> Tensor:
        """Routed experts (+ the shared expert) for routed tokens. `resident`: the caller made sure
        every routed expert is in the bank, so nothing is read back (graph-capturable)."""
        out = (self.experts.dispatch if resident else self.experts.forward)(self.layer, h, ids, weights)
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_expert_gate is not None:
                shared = F.sigmoid(self.shared_expert_gate(h)) * shared
            out = out + shared
        return out

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, ids = self.route(h)
        return self.combine(h, ids, weights).view(shape)
