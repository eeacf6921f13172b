"""The approximate miss policy: on decode steps, non-resident experts are dropped and the others renormalised.

Everything per call stays on the device (no sync, so decode steps are CUDA-graph capturable):
non-resident experts get weight 0, the remaining weights are rescaled to the original sum, and
per-expert use and miss counts accumulate in device counters. Every `refresh_every` tokens the
bank swaps its coldest resident experts for the most-missed ones (one read-back per refresh).
Prompts stay exact: the bank runs them through the fetch policy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from moestream.experts.format import Dispatch
from moestream.experts.residency import ResidencyPolicy
from moestream.experts.slots import SlotTable
from moestream.experts.stats import BankStats
from moestream.experts.transfer import Transfers


class SkipPolicy:
    def __init__(self, slots: SlotTable, transfers: Transfers, policy: ResidencyPolicy, stats: BankStats,
                 dispatch: dict[int, Dispatch], refresh_every: int = 16):
        self.slots, self.transfers, self.policy, self.stats = slots, transfers, policy, stats
        self.dispatch, self.refresh_every = dispatch, refresh_every
        E, device = slots.num_experts, slots.device
        self.miss_counts = {layer: torch.zeros(E, dtype=torch.int32, device=device) for layer in slots}
        self.use_counts = {layer: torch.zeros(E, dtype=torch.int32, device=device) for layer in slots}
        self.pair_counts = {layer: torch.zeros(2, dtype=torch.int64, device=device) for layer in slots}
        self._since_refresh = 0

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        ls = self.slots[layer]
        slots = ls.slot_map[expert_ids]
        present = slots >= 0
        kept = weights * present
        scale = weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True).clamp_min(1e-20)
        flat = expert_ids.reshape(-1)
        self.miss_counts[layer].index_add_(0, flat, (~present).reshape(-1).to(torch.int32))
        self.use_counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        n_present = present.sum()
        self.pair_counts[layer] += torch.stack((n_present, present.numel() - n_present))
        return self.dispatch[layer](hidden, ls.tensors, slots, (kept * scale).to(weights.dtype))

    def after_step(self, tokens: int) -> None:
        self._since_refresh += tokens
        if self._since_refresh >= self.refresh_every:
            self._since_refresh = 0
            self.refresh()

    def refresh(self) -> None:
        """Swap cold resident experts for hot missed ones (one sync per refresh)."""
        for layer in self.slots:
            misses = self.miss_counts[layer].cpu().numpy().copy()   # copies: on the CPU .cpu() aliases
            uses = self.use_counts[layer].cpu().numpy().copy()
            self.miss_counts[layer].zero_()
            self.use_counts[layer].zero_()
            self._fold_pairs(layer)
            promote_missed(self.slots, self.policy, self.transfers, self.stats, layer, misses, uses)

    def _fold_pairs(self, layer: int) -> None:
        hits, missed = self.pair_counts[layer].tolist()
        self.pair_counts[layer].zero_()
        self.stats.record(layer, hits=hits, misses=missed)

    def sync_stats(self) -> None:
        """Fold the device-side hit and miss counters into the host statistics."""
        for layer in self.slots:
            self._fold_pairs(layer)


def choose_promotions(slots: SlotTable, policy: ResidencyPolicy, layer: int, misses: np.ndarray, uses: np.ndarray,
                      margin: float = 1.0, most: int | None = None) -> list[tuple[int, int]]:
    """Fold a refresh period's per-expert use counts into the policy, then pair the most-missed
    experts with the coldest resident ones wherever the missed one's priority beats the victim's by
    more than `margin` times (at most `most` per layer): (expert in, victim out) pairs."""
    ls = slots[layer]
    used = np.nonzero(uses)[0]
    if len(used):
        policy.record(layer, used, uses[used])
    hot = [e for e in np.argsort(-misses, kind="stable").tolist() if misses[e] > 0 and e not in ls.where]
    if most is not None:
        hot = hot[:most]
    if not hot:
        return []
    resident = ls.resident()
    pinned = policy.pinned.get(layer, set())
    n = min(len(hot), len([e for e in resident if e not in pinned]))
    if not n:
        return []
    victims = policy.victims(layer, resident, n, set())
    cold = policy.priority(layer, np.array(victims, dtype=np.int64))
    warm = policy.priority(layer, np.array(hot[:n], dtype=np.int64))
    return [(h, v) for h, v, hp, vp in zip(hot[:n], victims, warm, cold) if hp > margin * vp]


def promote_missed(slots: SlotTable, policy: ResidencyPolicy, transfers: Transfers, stats: BankStats, layer: int,
                   misses: np.ndarray, uses: np.ndarray) -> None:
    """`choose_promotions`, then copy them in (the host waits)."""
    pairs = choose_promotions(slots, policy, layer, misses, uses)
    if pairs:
        done = slots.install(layer, [h for h, _ in pairs], [v for _, v in pairs], transfers)
        stats.record(layer, bytes_copied=done.bytes_copied, evictions=done.evictions, copy_wait_s=done.wait_s)
