"""The host tier: the bank copies missing experts from here.

`PinnedHostTier` keeps every expert in pinned RAM (fastest: one async DMA per expert).
`DiskHostTier` reads each miss from the checkpoint by byte range into a small ring of pinned
staging buffers, so a read of the next expert overlaps the copy of the previous one.
On the CPU the bank itself lives in RAM and misses are read from disk straight into the slot.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from moestream.experts.store import ExpertStore


def read_workers() -> int:
    return max(2, min(16, (os.cpu_count() or 2)))


def read_experts_into(store: ExpertStore, layer: int, experts: list[int], gate_up: torch.Tensor,
                      down: torch.Tensor) -> None:
    """Read experts[i] into gate_up[i], down[i] (CPU, store dtype) with parallel preads."""
    def one(i: int) -> None:
        store.read_into(layer, experts[i], gate_up[i], down[i])

    with ThreadPoolExecutor(read_workers()) as pool:
        list(pool.map(one, range(len(experts))))


class PinnedHostTier:
    name = "pinned"

    def __init__(self, store: ExpertStore, dtype: torch.dtype, pin: bool = True):
        self.store, self.dtype = store, dtype
        E = store.config.num_experts
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}
        experts = list(range(E))
        for layer in store.moe_layers:
            gu = torch.empty((E, *store.gate_up_shape), dtype=dtype, pin_memory=pin)
            dn = torch.empty((E, *store.down_shape), dtype=dtype, pin_memory=pin)
            if dtype == store.dtype:
                read_experts_into(store, layer, experts, gu, dn)
            else:
                raw_gu = torch.empty((E, *store.gate_up_shape), dtype=store.dtype)
                raw_dn = torch.empty((E, *store.down_shape), dtype=store.dtype)
                read_experts_into(store, layer, experts, raw_gu, raw_dn)
                gu.copy_(raw_gu)
                dn.copy_(raw_dn)
            self.gate_up[layer], self.down[layer] = gu, dn

    def copy_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        gate_up.copy_(self.gate_up[layer][expert], non_blocking=True)
        down.copy_(self.down[layer][expert], non_blocking=True)
        return gate_up.nbytes + down.nbytes

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.gate_up.values()) + sum(t.nbytes for t in self.down.values())


class DiskHostTier:
    name = "disk"

    def __init__(self, store: ExpertStore, device: torch.device, ring: int = 4):
        self.store, self.device = store, device
        pin = device.type == "cuda"
        self.ring = [store.new_buffers(pin=pin) for _ in range(ring if pin else 1)]
        self.events: list[torch.cuda.Event | None] = [None] * len(self.ring)
        self.next = 0

    def copy_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        direct = gate_up.device.type == "cpu" and gate_up.dtype == self.store.dtype
        if direct:  # CPU bank: read straight into the slot
            self.store.read_into(layer, expert, gate_up, down)
            return gate_up.nbytes + down.nbytes
        i = self.next
        self.next = (i + 1) % len(self.ring)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the DMA that last used this buffer has finished
        buf_gu, buf_dn = self.ring[i]
        self.store.read_into(layer, expert, buf_gu, buf_dn)
        gate_up.copy_(buf_gu, non_blocking=True)
        down.copy_(buf_dn, non_blocking=True)
        if gate_up.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.events[i] = ev
        return gate_up.nbytes + down.nbytes

    def nbytes(self) -> int:
        return 0
