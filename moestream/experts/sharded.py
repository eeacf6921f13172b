"""Expert parallel: each rank of a group holds a disjoint share of every layer's routed experts.

Placement is round-robin (expert e lives on rank e mod world), or, given a profile, balanced per
layer so the hottest experts spread over the ranks. Every rank owns the same number of experts
of every layer (±1), unless the ranks' budgets differ (heterogeneous cards): then each owns a
share in proportion to the bank memory its budget leaves (`expert_counts`), so every rank keeps
the same fraction of its experts resident. A rank's bank, host tier and residency policy see only its own experts, in a
local id space (local id i = the rank's i-th expert): `ShardStore` presents the checkpoint that way.
`ShardedExperts` is the model's `RoutedExperts` on every rank: routed ids become local ids, or -1
for another rank's expert (the bank skips those pairs; a fully resident rank hands its kernels one
table from global id straight to slot instead), the rank's bank computes its partial sum,
and one all-reduce per MoE layer adds the ranks' partials (counted and timed by
`CollectiveStats`). Routing itself is computed identically
on every rank (the router is replicated), so no ids need to travel.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from moestream import kernels
from moestream.experts.collective import CollectiveStats
from moestream.experts.format import ExpertFormat


def expert_counts(num_experts: int, weights: list[float]) -> tuple[int, ...]:
    """Experts per rank in proportion to `weights` (largest remainders; each rank at least one,
    their sum `num_experts`). Deterministic: every rank computes the same answer."""
    world = len(weights)
    total = float(sum(weights))
    if total <= 0:
        return tuple(len(range(r, num_experts, world)) for r in range(world))
    spare = num_experts - world   # one expert each first
    exact = [spare * w / total for w in weights]
    counts = [1 + int(x) for x in exact]
    for r in sorted(range(world), key=lambda r: (-(exact[r] - int(exact[r])), r))[:num_experts - sum(counts)]:
        counts[r] += 1
    return tuple(counts)


def interleaved_owners(num_experts: int, counts: tuple[int, ...]) -> list[list[int]]:
    """Per rank, the experts it holds when rank r holds counts[r] of them: each expert in turn to
    the rank furthest below its share (round-robin when the counts are round-robin's)."""
    owned: list[list[int]] = [[] for _ in counts]
    for e in range(num_experts):
        r = min((r for r, c in enumerate(counts) if len(owned[r]) < c), key=lambda r: (len(owned[r]) / counts[r], r))
        owned[r].append(e)
    return owned


def balanced_owners(frequencies: np.ndarray, world: int, counts: tuple[int, ...] | None = None) -> list[list[int]]:
    """Per rank, the experts it holds: hottest first, each to the least loaded rank with room
    (every rank keeps its count: round-robin's, or `counts`, so bank sizes stay as planned).
    Deterministic: every rank computes the same answer."""
    E = len(frequencies)
    quota = list(counts) if counts is not None else [len(range(r, E, world)) for r in range(world)]
    owned: list[list[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for e in np.argsort(-np.asarray(frequencies, dtype=np.float64), kind="stable").tolist():
        r = min((r for r in range(world) if len(owned[r]) < quota[r]), key=lambda r: (load[r], r))
        owned[r].append(e)
        load[r] += float(frequencies[e])
    return [sorted(o) for o in owned]


@dataclass(frozen=True)
class Placement:
    """Which experts this rank holds: round-robin (e mod world), or interleaved by `counts` (ranks
    with more memory hold more), or per MoE layer as given (a profile's balanced split). A rank
    holds the same number of experts in every layer."""

    rank: int
    world: int
    num_experts: int
    layers: dict[int, tuple[int, ...]] = field(default_factory=dict)   # MoE layer → this rank's experts
    counts: tuple[int, ...] | None = None   # experts per rank (None: round-robin's equal shares)

    @classmethod
    def balanced(cls, rank: int, world: int, num_experts: int, frequencies: dict[int, np.ndarray],
                 counts: tuple[int, ...] | None = None) -> Placement:
        """Hot experts spread over the ranks, layer by layer, by a profile's usage."""
        return cls(rank, world, num_experts,
                   {layer: tuple(balanced_owners(f, world, counts)[rank]) for layer, f in frequencies.items()}, counts)

    def experts(self, layer: int) -> list[int]:
        """Global ids of the experts this rank holds in `layer`, in local-id order."""
        held = self.layers.get(layer)
        if held is not None:
            return list(held)
        if self.counts is not None:
            return interleaved_owners(self.num_experts, self.counts)[self.rank]
        return list(range(self.rank, self.num_experts, self.world))

    @property
    def count(self) -> int:
        if self.counts is not None:
            return self.counts[self.rank]
        return len(range(self.rank, self.num_experts, self.world))

    def to_local(self, layer: int, device: torch.device) -> Tensor:
        """(E,) long: global id → local id in `layer`, -1 for another rank's expert."""
        table = torch.full((self.num_experts,), -1, dtype=torch.long)
        table[self.experts(layer)] = torch.arange(self.count)
        return table.to(device)

    def local_frequencies(self, layer: int, frequencies: np.ndarray) -> np.ndarray:
        return np.asarray(frequencies)[self.experts(layer)]

    def local_pins(self, pinned: dict[int, list[int]] | None) -> dict[int, list[int]] | None:
        """Pins this rank holds, as local ids (another rank pins the rest)."""
        if pinned is None:
            return None
        out = {}
        for layer, experts in pinned.items():
            local = {e: i for i, e in enumerate(self.experts(layer))}
            out[layer] = [local[e] for e in experts if e in local]
        return out


class ShardStore:
    """An expert store restricted to one rank's experts, addressed by local id."""

    def __init__(self, store, placement: Placement):
        self.inner, self.placement = store, placement
        self.global_ids = {layer: placement.experts(layer) for layer in store.moe_layers}
        self.config = replace(store.config, num_experts=placement.count)
        self.num_experts = placement.count

    def __getattr__(self, name: str):   # shape, spec, index, moe_layers, native, dtype: as the checkpoint's
        return getattr(self.inner, name)

    def read_into(self, layer: int, expert: int, fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self.inner.read_into(layer, self.global_ids[layer][expert], fmt, out)

    def read_many(self, layer: int, experts: list[int], fmt: ExpertFormat, out: Mapping[str, Tensor]) -> None:
        self.inner.read_many(layer, [self.global_ids[layer][e] for e in experts], fmt, out)


class ShardedExperts:
    """The model's routed experts on one rank of an expert-parallel group."""

    def __init__(self, bank, placement: Placement, group=None):
        self.bank, self.placement, self.group = bank, placement, group
        # global id → local id (-1: another rank's), on the host for segmented decode's read-back
        # routing and on the device for the dispatch
        self.host_local = {layer: placement.to_local(layer, torch.device("cpu")).numpy() for layer in bank.layers}
        self.local = {layer: torch.from_numpy(table).to(bank.device) for layer, table in self.host_local.items()}
        # A fully resident bank never moves an expert: its slot table composed with the global → local
        # one maps routed ids straight to slots (-1: another rank's) inside the MoE kernels, with no
        # per-layer translation. Its lookups are this rank's pairs, counted on the device (one launch
        # a layer, no sync) and folded into its statistics when they are read.
        self.slot_maps = ({layer: _composed(self.local[layer], bank.slots[layer].slot_map) for layer in bank.layers}
                          if bank.fully_resident else None)
        self.owned = ({layer: torch.zeros((), dtype=torch.int64, device=bank.device) for layer in bank.layers}
                      if bank.fully_resident else None)
        if self.owned is not None:
            bank.external_hits = self._fold_hits
        # gloo reduces fp32 and fp16 but not bf16 everywhere; NCCL reduces any of them in place.
        gloo = dist.get_backend(group) == "gloo"
        self.reduce_fp32 = gloo
        self.collectives = CollectiveStats(bank.device, events=not gloo and bank.device.type == "cuda")

    def bank_ids(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """Routed ids read back on the host as this rank's bank numbers them (-1: another rank's
        expert): what a segmented decode step hands the bank to make resident."""
        return self.host_local[layer][np.asarray(expert_ids, dtype=np.int64)]

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        if self.slot_maps is not None:
            return self.dispatch(layer, hidden, expert_ids, weights)
        return self._sum(layer, self.bank.forward(layer, hidden, self._to_local(layer, expert_ids), weights))

    def dispatch(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        if self.slot_maps is not None:   # global ids, looked up in the composed table by the kernels
            kernels.count_mapped(expert_ids, self.slot_maps[layer], self.owned[layer])
            return self._sum(layer, self.bank.dispatch(layer, hidden, expert_ids, weights,
                                                       slot_map=self.slot_maps[layer]))
        return self._sum(layer, self.bank.dispatch(layer, hidden, self._to_local(layer, expert_ids), weights))

    def _to_local(self, layer: int, expert_ids: Tensor) -> Tensor:
        return self.local[layer][expert_ids]

    def _fold_hits(self) -> None:
        for layer, count in self.owned.items():
            self.bank.stats.record(layer, hits=int(count))
            count.zero_()

    def _sum(self, layer: int, partial: Tensor) -> Tensor:
        total = partial.float() if self.reduce_fp32 and partial.dtype != torch.float32 else partial
        self.collectives.run(layer, self._all_reduce, total)
        return total.to(partial.dtype)

    def _all_reduce(self, tensor: Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


def _composed(local: Tensor, slot_map: Tensor) -> Tensor:
    """(E_global + 1,) int32: global id → slot of this rank's bank, -1 for another rank's expert (and
    in the last entry, as every slot table has)."""
    table = torch.full((local.numel() + 1,), -1, dtype=torch.int32, device=slot_map.device)
    table[:-1] = slot_map[local]   # local -1 reads the slot table's last entry, -1
    return table
