"""The exact miss policy: a layer's missing experts are brought in before its experts run.

A layer that can miss reads its routing back once (the one host sync it needs), copies the
missing experts over evicted slots (the residency policy picks the victims), then dispatches over
the updated slot map. A call that routes to more experts than the bank can take at once (long
prompts) leaves the bank as it is and streams the missing experts through a double-buffered
staging area instead, so a prompt neither thrashes the decode bank nor needs every expert.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import Tensor

from moestream.experts.format import Dispatch, ExpertFormat, ExpertShape
from moestream.experts.prefetch import Prefetcher
from moestream.experts.residency import ResidencyPolicy
from moestream.experts.slots import SlotTable
from moestream.experts.stats import BankStats
from moestream.experts.transfer import Transfers


def staging_half(staging_slots: int, top_k: int) -> int:
    """Slots in each of the two staging buffers (the memory plan gives the total)."""
    return max(1, staging_slots // 2) if staging_slots else max(top_k, 8)


class Fetcher:
    def __init__(self, slots: SlotTable, transfers: Transfers, policy: ResidencyPolicy, stats: BankStats,
                 dispatch: dict[int, Dispatch], shape: ExpertShape, top_k: int, staging_slots: int,
                 prefetcher: Prefetcher | None = None):
        """`dispatch`: per MoE layer, the dispatch of that layer's expert format."""
        self.slots, self.transfers, self.policy, self.stats = slots, transfers, policy, stats
        self.dispatch, self.prefetcher = dispatch, prefetcher
        half = staging_half(staging_slots, top_k)
        formats: dict[str, ExpertFormat] = {fmt.name: fmt for fmt in slots.formats.values()}
        self.staging = {name: [fmt.empty(shape, half, device=slots.device) for _ in range(2)]
                        for name, fmt in formats.items()}
        self._turn = 0
        self._staging_done: list[torch.cuda.Event | None] = [None, None]

    def forward(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        ls = self.slots[layer]
        flat = expert_ids.reshape(-1).cpu().numpy()          # the one host sync of a layer that may miss
        flat = flat[flat >= 0]                                # -1: held elsewhere (another rank's expert)
        experts = np.unique(flat)
        missing = [e for e in experts.tolist() if e not in ls.where]
        free = self.slots.capacity - len(self.policy.pinned.get(layer, ())) - (len(experts) - len(missing))
        if missing and (len(missing) > free or hidden.shape[0] > self.slots.capacity):
            return self._staged(layer, hidden, expert_ids, weights, flat, missing)
        self.ensure_resident(layer, flat)
        return self.dispatch[layer](hidden, ls.tensors, ls.slot_map[expert_ids], weights)

    def ensure_resident(self, layer: int, routed: np.ndarray, wait: str = "host") -> None:
        """Host side of a fetch: count hits and misses, copy missing experts into evicted slots.

        Experts prefetched for this layer count as hits (their copies were issued ahead); the
        compute stream (wait="device") or the host waits for those copies before the experts run.
        """
        ls = self.slots[layer]
        experts, counts = np.unique(routed[routed >= 0], return_counts=True)
        self.policy.record(layer, experts, counts)
        ids = experts.tolist()
        resident = np.fromiter((e in ls.where for e in ids), dtype=bool, count=len(ids))
        missing = experts[~resident].tolist()
        record = dict(hits=int(counts[resident].sum()), misses=int(counts[~resident].sum()))
        settled = self.prefetcher.settle(layer, ids) if self.prefetcher is not None else None
        if settled is not None and settled.scored:   # copies this call needed: issued ahead or not
            record.update(predicted_hits=settled.predicted_hits, predicted_total=settled.predicted_total,
                          prefetch_used=settled.prefetch_used, demand_copies=len(missing))
        if missing:   # queued after any prefetch on the same copy stream: waiting on it covers both
            victims = self.policy.victims(layer, ls.resident(), len(missing), set(ids))
            done = self.slots.install(layer, missing, victims, self.transfers, wait=wait)
            record.update(bytes_copied=done.bytes_copied, evictions=done.evictions, copy_wait_s=done.wait_s)
        elif settled is not None and settled.pending is not None:
            t0 = time.perf_counter()
            self.transfers.wait(settled.pending, wait)
            record.update(copy_wait_s=time.perf_counter() - t0)
        self.stats.record(layer, **record)

    def _staged(self, layer: int, hidden: Tensor, expert_ids: Tensor, weights: Tensor, flat: np.ndarray,
                missing: list[int]) -> Tensor:
        """Resident experts from the bank, missing ones streamed through two staging buffers.

        While one buffer's experts compute, the next group is copied into the other one; the stage
        maps of every group are uploaded in one copy so the host never waits in between.
        """
        t0 = time.perf_counter()
        experts, counts = np.unique(flat, return_counts=True)
        self.policy.record(layer, experts, counts)
        missed = np.isin(experts, missing)
        ls = self.slots[layer]
        dispatch, staging = self.dispatch[layer], self.staging[self.slots.formats[layer].name]
        out = dispatch(hidden, ls.tensors, ls.slot_map[expert_ids], weights).float()
        group = next(iter(staging[0].values())).shape[0]
        groups = [missing[i:i + group] for i in range(0, len(missing), group)]
        stage_maps = torch.full((len(groups), self.slots.num_experts + 1), -1, dtype=torch.int32)   # [-1]: no slot
        for g, chunk in enumerate(groups):
            stage_maps[g, torch.tensor(chunk)] = torch.arange(len(chunk), dtype=torch.int32)
        stage_maps = stage_maps.to(self.slots.device)
        copied_total = 0
        compute = torch.cuda.current_stream(self.slots.device) if self.slots.device.type == "cuda" else None
        for g, chunk in enumerate(groups):
            turn = self._turn
            buf = staging[turn]
            copied, ready = self.transfers.copy(layer, chunk, [{n: t[i] for n, t in buf.items()} for i in range(len(chunk))],
                                                after=self._staging_done[turn])
            copied_total += copied
            self.transfers.wait(ready, "device")
            out += dispatch(hidden, buf, stage_maps[g][expert_ids], weights).float()
            if compute is not None:
                done = torch.cuda.Event()
                done.record()
                self._staging_done[turn] = done
            self._turn ^= 1
        result = out.to(hidden.dtype)
        if compute is not None:
            compute.synchronize()
        self.stats.record(layer, hits=int(counts[~missed].sum()), misses=int(counts[missed].sum()),
                          bytes_copied=copied_total,
                          copy_wait_s=time.perf_counter() - t0)   # the streamed section is bound by its copies
        return result
