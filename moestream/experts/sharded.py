"""Expert parallel: each rank of a group holds a disjoint share of every layer's routed experts.

Placement is round-robin (expert e lives on rank e mod world), so every rank owns the same number
of experts of every layer (±1) and, under any routing that does not single out residues, the same
share of the work. A rank's bank, host tier and residency policy see only its own experts, in a
local id space (local id i = the rank's i-th expert): `ShardStore` presents the checkpoint that way.
`ShardedExperts` is the model's `RoutedExperts` on every rank: routed ids become local ids, or -1
for another rank's expert (the bank skips those pairs), the rank's bank computes its partial sum,
and one all-reduce per MoE layer adds the ranks' partials. Routing itself is computed identically
on every rank (the router is replicated), so no ids need to travel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moestream.experts.format import ExpertFormat


@dataclass(frozen=True)
class Placement:
    rank: int
    world: int
    num_experts: int

    @property
    def local_experts(self) -> list[int]:
        """Global ids of the experts this rank owns, in local-id order."""
        return list(range(self.rank, self.num_experts, self.world))

    @property
    def count(self) -> int:
        return len(self.local_experts)

    def to_local(self, device: torch.device) -> Tensor:
        """(E,) long: global id → local id, -1 for another rank's expert."""
        table = torch.full((self.num_experts,), -1, dtype=torch.long)
        table[self.local_experts] = torch.arange(self.count)
        return table.to(device)

    def local_frequencies(self, frequencies: np.ndarray) -> np.ndarray:
        return np.asarray(frequencies)[self.local_experts]

    def local_pins(self, pinned: dict[int, list[int]] | None) -> dict[int, list[int]] | None:
        if pinned is None:
            return None
        return {layer: [e // self.world for e in experts if e % self.world == self.rank]
                for layer, experts in pinned.items()}


class ShardStore:
    """An expert store restricted to one rank's experts, addressed by local id."""

    def __init__(self, store, placement: Placement):
        self.inner, self.placement = store, placement
        self.global_ids = placement.local_experts
        self.config = replace(store.config, num_experts=placement.count)
        self.num_experts = placement.count

    def __getattr__(self, name: str):   # shape, spec, index, moe_layers, native, dtype: as the checkpoint's
        return getattr(self.inner, name)

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self.inner.read_into(layer, self.global_ids[expert], fmt, out)

    def read_many(self, layer: int, experts: list[int], fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self.inner.read_many(layer, [self.global_ids[e] for e in experts], fmt, out)


class ShardedExperts:
    """The model's routed experts on one rank of an expert-parallel group."""

    def __init__(self, bank, placement: Placement, group=None):
        self.bank, self.placement, self.group = bank, placement, group
        self.local = placement.to_local(bank.device)
        # A fully resident bank counts no lookups itself: count this rank's pairs on the device
        # (no sync) and fold them into its statistics when they are read.
        self.owned = ({layer: torch.zeros((), dtype=torch.int64, device=bank.device) for layer in bank.layers}
                      if bank.fully_resident else None)
        if self.owned is not None:
            bank.external_hits = self._fold_hits
        # gloo reduces fp32 and fp16 but not bf16 everywhere; NCCL reduces any of them in place.
        self.reduce_fp32 = dist.get_backend(group) == "gloo"

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        return self._sum(self.bank.forward(layer, hidden, self._to_local(layer, expert_ids), weights))

    def dispatch(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        return self._sum(self.bank.dispatch(layer, hidden, self._to_local(layer, expert_ids), weights))

    def _to_local(self, layer: int, expert_ids: Tensor) -> Tensor:
        local = self.local[expert_ids]
        if self.owned is not None:
            self.owned[layer] += (local >= 0).sum()
        return local

    def _fold_hits(self) -> None:
        for layer, count in self.owned.items():
            self.bank.stats.record(layer, hits=int(count))
            count.zero_()

    def _sum(self, partial: Tensor) -> Tensor:
        if self.reduce_fp32 and partial.dtype != torch.float32:
            total = partial.float()
            dist.all_reduce(total, group=self.group)
            return total.to(partial.dtype)
        dist.all_reduce(partial, group=self.group)
        return partial
