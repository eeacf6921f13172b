"""The host tier: the bank copies missing experts from here.

`PinnedHostTier` keeps every expert in pinned RAM, already in the bank's format (fastest: one
async DMA per tensor). `DiskHostTier` reads each miss from the checkpoint by byte range into a
small ring of pinned staging buffers, so the read of the next expert overlaps the copy of the
previous one. On the CPU the bank itself lives in RAM and misses are read straight into the slot.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from moestream.errors import InputError
from moestream.experts.format import ExpertFormat
from moestream.experts.store import ExpertStore

HOST_TIERS = ("auto", "pinned", "disk")


class PinnedHostTier:
    name = "pinned"

    def __init__(self, store: ExpertStore, formats: dict[int, ExpertFormat], pin: bool = True):
        self.store, self.formats = store, formats
        experts = list(range(store.num_experts))
        self.layers: dict[int, dict[str, Tensor]] = {}
        for layer, fmt in formats.items():
            stack = fmt.empty(store.shape, store.num_experts, pin=pin)
            store.read_many(layer, experts, fmt, stack)
            self.layers[layer] = stack

    def copy_into(self, layer: int, expert: int, dest: Mapping[str, Tensor]) -> int:
        copied = 0
        for name, t in dest.items():
            t.copy_(self.layers[layer][name][expert], non_blocking=True)
            copied += t.nbytes
        return copied

    def copy_rows(self, layer: int, experts: list[int], dest: Mapping[str, Tensor]) -> int:
        """Copy experts[i] into row i of the stacked `dest`, one copy per tensor for each run of
        consecutive experts: PCIe reads a few large copies faster than many 3-6 MB ones."""
        copied = 0
        stack = self.layers[layer]
        for row, first, count in consecutive_runs(experts):
            for name, t in dest.items():
                t[row:row + count].copy_(stack[name][first:first + count], non_blocking=True)
                copied += t[row:row + count].nbytes
        return copied

    def load(self, layer: int, experts: list[int], dest: Mapping[str, Tensor]) -> None:
        """Bulk copy of experts[i] into row i of the stacked `dest` (a bank's first fill)."""
        idx = torch.tensor(experts)
        for name, t in dest.items():
            t[:len(experts)].copy_(self.layers[layer][name][idx])

    def nbytes(self) -> int:
        return sum(t.nbytes for stack in self.layers.values() for t in stack.values())


class DiskHostTier:
    name = "disk"

    def __init__(self, store: ExpertStore, formats: dict[int, ExpertFormat], device: torch.device, ring: int = 4):
        self.store, self.formats, self.device = store, formats, device
        pin = device.type == "cuda"
        size = ring if pin else 1
        by_name = {fmt.name: fmt for fmt in formats.values()}
        self.rings = {name: [fmt.empty(store.shape, pin=pin) for _ in range(size)] for name, fmt in by_name.items()}
        self.events: list[torch.cuda.Event | None] = [None] * size   # one ring position serves every format
        self.next = 0

    def copy_into(self, layer: int, expert: int, dest: Mapping[str, Tensor]) -> int:
        nbytes = sum(t.nbytes for t in dest.values())
        fmt = self.formats[layer]
        if all(t.device.type == "cpu" for t in dest.values()):   # CPU bank: read straight into the slot
            self.store.read_into(layer, expert, fmt, dest)
            return nbytes
        i = self.next
        self.next = (i + 1) % len(self.events)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the DMA that last used this position has finished
        buf = self.rings[fmt.name][i]
        self.store.read_into(layer, expert, fmt, buf)
        for name, t in dest.items():
            t.copy_(buf[name], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev
        return nbytes

    def copy_rows(self, layer: int, experts: list[int], dest: Mapping[str, Tensor]) -> int:
        """Copy experts[i] into row i of the stacked `dest` (one read and copy per expert)."""
        return sum(self.copy_into(layer, e, {name: t[i] for name, t in dest.items()}) for i, e in enumerate(experts))

    def load(self, layer: int, experts: list[int], dest: Mapping[str, Tensor]) -> None:
        read_stack(self.store, self.formats[layer], layer, experts, dest)

    def nbytes(self) -> int:
        return 0


def consecutive_runs(experts: list[int]) -> list[tuple[int, int, int]]:
    """(row, first expert, count) for each run of consecutive ids in `experts` (row: its position)."""
    runs: list[tuple[int, int, int]] = []
    for row, e in enumerate(experts):
        if runs and runs[-1][1] + runs[-1][2] == e:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, e, 1))
    return runs


def read_stack(store: ExpertStore, fmt: ExpertFormat, layer: int, experts: list[int],
               dest: Mapping[str, Tensor]) -> None:
    """Read experts[i] into row i of the stacked `dest` with parallel preads (straight into CPU
    tensors; through one pinned buffer and a copy for device tensors)."""
    if all(t.device.type == "cpu" for t in dest.values()):
        store.read_many(layer, experts, fmt, {name: t[:len(experts)] for name, t in dest.items()})
        return
    buf = fmt.empty(store.shape, len(experts), pin=True)
    store.read_many(layer, experts, fmt, buf)
    for name, t in dest.items():
        t[:len(experts)].copy_(buf[name])


def make_host_tier(kind, store: ExpertStore, formats: dict[int, ExpertFormat], device: torch.device,
                   host_memory: int | None) -> PinnedHostTier | DiskHostTier:
    """auto: pinned RAM when every expert fits `host_memory` (default 60% of available RAM), else disk.
    On the CPU the bank is RAM already: misses are read from disk into the slot (or, with "pinned",
    from a RAM copy of every expert, which hybrid misses compute from). An existing tier
    (of the same checkpoint and format) is shared as it is: benchmarks load several banks over one."""
    if not isinstance(kind, str):
        return kind
    if kind not in HOST_TIERS:
        raise InputError(f"host tier {kind!r} is unknown; use one of {', '.join(HOST_TIERS)}.")
    if device.type == "cpu":   # the bank is RAM already: misses read from disk, unless a RAM copy is asked for
        return PinnedHostTier(store, formats, pin=False) if kind == "pinned" else DiskHostTier(store, formats, device)
    if kind == "auto":
        total = sum(fmt.nbytes(store.shape) for fmt in formats.values()) * store.num_experts
        limit = host_memory if host_memory is not None else int(0.6 * available_ram())
        kind = "pinned" if total <= limit else "disk"
    if kind == "pinned":
        return PinnedHostTier(store, formats)
    return DiskHostTier(store, formats, device)


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30
