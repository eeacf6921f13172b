"""The bank: a bounded, per-layer set of device-resident experts, and the model's routed experts.

`ExpertBank` implements the model's `RoutedExperts` protocol (`forward`, `dispatch`) and the
runtime's per-step hooks. It composes the parts that each own one concern:

  slots.py     slot tensors, slot map and host mirror (the only writer of residency state)
  transfer.py  host tier → slot copies on the copy stream
  residency.py which experts stay (LCP, LRU, pins)
  fetch.py     exact misses (fetch, or stream long prompts through staging)
  skip.py      approximate misses on decode steps (drop and renormalise)
  hybrid.py    exact misses on decode steps without host work: the GPU reads some from host RAM in
               place, a CPU worker thread computes the others, all inside CUDA graphs
  prefetch.py  next-layer prediction and its accuracy gate
  stats.py     counters per layer

Capacity = E takes the same slot path with an identity slot map and never reads anything back.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from moestream.errors import BudgetError
from moestream.experts.fetch import Fetcher
from moestream.experts.format import ExpertFormat
from moestream.experts.host_tier import read_stack
from moestream.experts.hybrid import HybridMisses
from moestream.experts.prefetch import Prefetcher
from moestream.experts.residency import POLICIES, ResidencyPolicy
from moestream.experts.skip import SkipPolicy
from moestream.experts.slots import LayerSlots, SlotTable
from moestream.experts.stats import BankStats
from moestream.experts.store import ExpertStore
from moestream.experts.transfer import Transfers

MISS_POLICIES = ("fetch", "skip", "hybrid")


class ExpertBank:
    def __init__(self, store: ExpertStore, formats: dict[int, ExpertFormat], device: torch.device, capacity: int,
                 tier=None, miss_policy: str = "fetch", residency: str = "lcp", staging_slots: int = 0,
                 pinned: dict[int, list[int]] | None = None, prefetch: bool = False, refresh_every: int = 16,
                 cpu_misses: float | str | None = None, cpu_threads: int | None = None,
                 policy_note: str | None = None, layer_experts: int | None = None,
                 prompt_cpu_misses: float | str = 0.0):
        """`formats`: the expert format of every MoE layer; `capacity` comes from the memory plan
        (already checked against the model); `tier` is the host tier misses are copied from (None
        when every expert is resident). `cpu_misses`: with the fetch policy, the share of a decode
        call's misses the CPU computes (or "auto"); with the hybrid policy, the CPU's share of a
        one-token call's missing experts (None or "auto": moved while decoding until both sides finish
        together, `hybrid.SplitBalance`). `prompt_cpu_misses`: the share of a streamed prompt chunk's
        missing experts the CPU computes while the rest stream in (either policy; 0: none). `policy_note`: why the miss policy is what it is, where an
        automatic choice fell back (printed by `--stats`)."""
        config = store.config
        self.store, self.formats, self.device = store, formats, device
        self.dtype = next(iter(formats.values())).dtype if formats else torch.float32
        self.num_experts, self.top_k, self.capacity = config.num_experts, config.top_k, capacity
        self.fully_resident = capacity == self.num_experts
        self.miss_policy, self.policy_note = miss_policy, policy_note
        self.policy: ResidencyPolicy = POLICIES[residency](self.num_experts)
        self.stats = BankStats()
        self.tier = tier
        # Kernel tiles sized for the whole layer's rows per expert (a rank of a group: the model's
        # layer, `layer_experts`), whichever slots a call reads: the bank's, or a staging buffer's.
        by_name = {fmt.name: fmt.dispatch(device, store.shape, layer_experts=layer_experts or self.num_experts)
                   for fmt in formats.values()}
        self._dispatch = {layer: by_name[fmt.name] for layer, fmt in formats.items()}
        # A dispatch that reads back from the device (the plain-torch reference on CUDA, where Triton is
        # missing) cannot be captured in a CUDA graph: decode then runs eagerly.
        self.dispatch_syncs = any(fmt.dispatch_syncs(device, store.shape) for fmt in formats.values())
        self.slots = SlotTable(formats, capacity, self.num_experts, store.shape, device)
        self.transfers = Transfers(tier, device)
        self.prefetcher = Prefetcher(self.slots, self.transfers, self.policy) if prefetch and not self.fully_resident else None
        host_stacks = getattr(tier, "layers", None)   # every expert in host RAM (the pinned tier)
        hybrid = miss_policy == "hybrid" and not self.fully_resident
        self.fetcher = None if self.fully_resident else Fetcher(
            self.slots, self.transfers, self.policy, self.stats, self._dispatch, store.shape, self.top_k,
            staging_slots, self.prefetcher, host_stacks, 0.0 if hybrid else (cpu_misses or 0.0),
            prompt_cpu_misses or 0.0)
        self.hybrid_misses = HybridMisses(
            self.slots, self.transfers, self.policy, self.stats, self._dispatch, host_stacks, store.shape,
            self.top_k, cpu_misses, cpu_threads) if hybrid else None
        self.skip = (SkipPolicy(self.slots, self.transfers, self.policy, self.stats, self._dispatch, refresh_every)
                     if miss_policy == "skip" and not self.fully_resident else None)
        self.decoding = False   # set per step by the runtime: skip applies to decode steps only
        # Who counts a fully resident bank's hits when not every routed pair is its own (expert
        # parallel: a rank sees only its experts' pairs): a callable that records them, else None.
        self.external_hits = None
        for layer, experts in (pinned or {}).items():
            self.pin(layer, experts, load=False)

    @property
    def layers(self) -> dict[int, LayerSlots]:
        return self.slots.layers

    @property
    def prefetch_enabled(self) -> bool:
        return self.prefetcher is not None

    # ---- filling ------------------------------------------------------------------------
    def initial_experts(self, layer: int) -> list[int]:
        """Pinned first, then the policy's ranking (seeded by discovery or a profile when there is one)."""
        if self.fully_resident:
            return list(range(self.num_experts))
        pinned = sorted(self.policy.pinned.get(layer, ()))
        rest = [e for e in self.policy.ranking(layer) if e not in set(pinned)]
        return (pinned + rest)[: self.capacity]

    def fill(self) -> None:
        """Read every slot's expert from the host tier or the checkpoint (all of them at capacity E)."""
        self._land_promotions()
        for layer in self.slots:
            self.slots.fill(layer, self.initial_experts(layer), lambda experts, dest, layer=layer: self._load(layer, experts, dest))

    def _load(self, layer: int, experts: list[int], dest) -> None:
        if self.tier is not None:
            self.tier.load(layer, experts, dest)
        else:
            read_stack(self.store, self.formats[layer], layer, experts, dest)

    def swap_in(self, layer: int, wanted: list[int]) -> int:
        """Make `wanted` (at most capacity experts) resident in `layer`, evicting others chosen by the
        policy (never pinned or wanted ones); returns how many experts were copied in."""
        self._land_promotions()
        ls = self.slots[layer]
        missing = [e for e in wanted if e not in ls.where]
        if not missing:
            return 0
        victims = self.policy.victims(layer, ls.resident(), len(missing), set(wanted))
        done = self.slots.install(layer, missing, victims, self.transfers)
        self.stats.record(layer, bytes_copied=done.bytes_copied, evictions=done.evictions, copy_wait_s=done.wait_s)
        return len(missing)

    def pin(self, layer: int, experts: list[int], load: bool = True) -> None:
        """Keep these experts resident for good; loads them now when the bank is filled."""
        experts = sorted(set(int(e) for e in experts))
        if len(experts) > self.capacity - self.top_k and not self.fully_resident:
            raise BudgetError(f"pinning {len(experts)} experts in layer {layer} leaves fewer than top-{self.top_k} "
                              f"free slots of {self.capacity}; pin fewer experts or raise the capacity.")
        self.policy.pinned[layer] = set(experts)
        if load and not self.fully_resident:
            self.swap_in(layer, experts)

    # ---- the model's routed experts (RoutedExperts protocol) ----------------------------
    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        if self.fully_resident:   # hits are counted in after_step: this path may run as a CUDA graph replay
            return self.dispatch(layer, hidden, expert_ids, weights)
        if self.skip is not None and self.decoding:
            return self.skip.forward(layer, hidden, expert_ids, weights)
        if self.hybrid_misses is not None:
            if self.hybrid_misses.takes(hidden.shape[0]):
                return self.hybrid_misses.forward(layer, hidden, expert_ids, weights)
            self.hybrid_misses.land(wait=True)   # the fetch policy's installs see only whole slots
        return self.fetcher.forward(layer, hidden, expert_ids, weights)

    def dispatch(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor,
                 slot_map: Tensor | None = None) -> Tensor:
        """Device-only dispatch through the current slot map (or `slot_map`, a table of the same slots
        for other ids: an expert-parallel rank's global ids): the caller guarantees residency."""
        ls = self.slots[layer]
        return self._dispatch[layer](hidden, ls.tensors, expert_ids, weights,
                                     slot_map=ls.slot_map if slot_map is None else slot_map)

    # ---- the runtime's hooks ------------------------------------------------------------
    @property
    def graph_safe(self) -> bool:
        """A decode step reads nothing back: it can be captured and replayed as a CUDA graph."""
        return ((self.fully_resident or self.skip is not None or self.hybrid_misses is not None)
                and not self.dispatch_syncs)

    def can_segment(self, batch: int) -> bool:
        """Decode of `batch` tokens can always be made resident before its experts run (fetch policy)."""
        if self.fetcher is None or self.skip is not None or self.hybrid_misses is not None or self.dispatch_syncs:
            return False
        most_pinned = max((len(p) for p in self.policy.pinned.values()), default=0)
        return batch * self.top_k <= self.capacity - most_pinned and batch <= self.capacity

    @property
    def hybrid(self) -> bool:
        """Some misses of decode steps are computed on the CPU from host RAM (`cpu_misses`)."""
        return self.fetcher is not None and self.fetcher.cpu_share != 0

    def ensure_resident(self, layer: int, expert_ids: np.ndarray, wait: str = "host") -> None:
        self.fetcher.ensure_resident(layer, expert_ids, wait)

    def ensure_resident_hybrid(self, layer: int, routed: np.ndarray, hidden: Tensor, weights: Tensor,
                               wait: str = "host") -> Tensor | None:
        """Like `ensure_resident`, computing a share of the misses on the CPU (`routed`: the call's
        (T, k) routing, read back): their fp32 rows, to add, or None."""
        return self.fetcher.ensure_resident_hybrid(layer, routed, hidden, weights, wait)

    def prefetch(self, layer: int, predicted: np.ndarray) -> None:
        if self.prefetcher is not None:
            self.stats.record(layer, prefetched=self.prefetcher.issue(layer, predicted))

    def begin_step(self, decoding: bool, live_rows: int | None = None) -> None:
        """Called before each forward: one token per sequence lets the skip policy apply (prompts stay
        exact); the hybrid policy's maps follow any change of the bank since the last step, and it
        computes nothing for rows past `live_rows` (the padding of a captured batch; None: all live)."""
        self.decoding = decoding
        if self.hybrid_misses is not None:
            self.hybrid_misses.note_step(decoding)
            self.hybrid_misses.sync_maps()
            self.hybrid_misses.set_live_rows(live_rows)

    def after_step(self, tokens: int) -> None:
        """Advance the residency clock; with the skip or hybrid policy, refresh the bank from its
        device-side miss counters now and then."""
        self.stats.tokens += tokens
        self.policy.advance(tokens)
        if self.fully_resident and self.external_hits is None:
            for layer in self.slots:
                self.stats.record(layer, hits=tokens * self.top_k)
        elif self.skip is not None:
            self.skip.after_step(tokens)
        elif self.hybrid_misses is not None:
            self.hybrid_misses.after_step(tokens)

    def sync_stats(self) -> None:
        """Fold device-side counters (skip and hybrid policies) into the host statistics."""
        if self.skip is not None:
            self.skip.sync_stats()
        if self.hybrid_misses is not None:
            self.hybrid_misses.sync_stats()
        if self.external_hits is not None:
            self.external_hits()

    def close(self) -> None:
        """Stop the hybrid policy's CPU worker thread and the prompts' CPU thread (a bank that is dropped
        stops them too)."""
        if self.hybrid_misses is not None:
            self.hybrid_misses.close()
        if self.fetcher is not None:
            self.fetcher.close()

    def synchronize(self) -> None:
        """Every queued copy has landed and every slot holds its expert (before reading or replacing
        slot tensors wholesale)."""
        self._land_promotions()
        self.transfers.synchronize()

    def _land_promotions(self) -> None:
        """The hybrid policy's promotions in flight join the bank (before anything else changes it)."""
        if self.hybrid_misses is not None:
            self.hybrid_misses.land(wait=True)
