"""Bank slots: per MoE layer, the stacked slot tensors of the expert format, the device slot map
and its host mirror. `SlotTable` is the one writer of all of it.

Per layer: `tensors` holds one stacked tensor per format tensor (dense: gate_up (S, 2I, H) and
down (S, H, I)) for S = capacity slots; `slot_map` (E + 1,) int32 on the device maps an expert id to
its slot (-1 when not resident), which dispatch reads with one device-side gather; its last entry is
always -1, so a routed id of -1 (an expert this bank does not hold, e.g. another rank's) maps to no
slot and the kernels skip the pair; `owner`
(slot → expert) and `where` (expert → slot) mirror it on the host, so a miss is decided without
reading the device. Fill, installs on a miss, prefetch, snapshot restore and profile seeding all
go through the methods below, so the three views never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from moestream.experts.format import ExpertFormat, ExpertShape
from moestream.experts.transfer import Transfers


@dataclass
class LayerSlots:
    tensors: dict[str, Tensor]   # format tensor name → (S, ...) stacked slots
    slot_map: Tensor             # (E + 1,) int32 on the device; [-1] is always -1
    owner: list[int]             # host mirror: slot → expert id; FREE, or LANDING while a copy is in flight
    where: dict[int, int]        # host mirror: expert id → slot

    def views(self, slot: int) -> dict[str, Tensor]:
        return {name: t[slot] for name, t in self.tensors.items()}

    def resident(self) -> np.ndarray:
        owner = np.asarray(self.owner, dtype=np.int64)
        return owner[owner >= 0]

    def host_map(self, num_experts: int, outside: int | None = None) -> Tensor:
        """The slot map built on the host from `where` (no read of the device): (E + 1,) int32, each
        resident expert's slot; the others -1, or `outside` + e where given (a map whose values past
        the slots name the expert itself)."""
        out = torch.full((num_experts + 1,), -1, dtype=torch.int32)
        if outside is not None:
            out[:num_experts] = outside + torch.arange(num_experts, dtype=torch.int32)
        if self.where:
            out[torch.tensor(list(self.where))] = torch.tensor(list(self.where.values()), dtype=torch.int32)
        return out


FREE, LANDING = -1, -2   # owner values of a slot without an expert: free, or awaiting a copy in flight


@dataclass
class Landing:
    """Copies into a layer's slots still in flight (`SlotTable.begin_install`): no map names those
    slots until `SlotTable.finish_install` makes the experts resident."""

    layer: int
    experts: list[int]
    slots: list[int]
    done: torch.cuda.Event | None   # the copies' event (None: they have landed, CPU)

    def landed(self) -> bool:
        return self.done is None or self.done.query()


@dataclass
class Installed:
    """What one install did (for the bank's statistics)."""

    bytes_copied: int = 0
    evictions: int = 0
    wait_s: float = 0.0
    done: torch.cuda.Event | None = None   # the copies' event when the caller did not wait


class SlotTable:
    def __init__(self, formats: dict[int, ExpertFormat], capacity: int, num_experts: int, shape: ExpertShape,
                 device: torch.device):
        """`formats`: the expert format of every MoE layer (layers may differ, e.g. the first and last at 8 bits)."""
        self.capacity, self.num_experts, self.formats, self.device = capacity, num_experts, formats, device
        self.layer_version = {layer: 0 for layer in formats}   # bumped on every change of a layer's residency
        self.layers: dict[int, LayerSlots] = {
            layer: LayerSlots(fmt.empty(shape, capacity, device=device),
                              torch.full((num_experts + 1,), -1, dtype=torch.int32, device=device), [-1] * capacity, {})
            for layer, fmt in formats.items()}

    def __getitem__(self, layer: int) -> LayerSlots:
        return self.layers[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def is_filled(self) -> bool:
        """No slot is free (one awaiting its copy is not)."""
        return all(e != FREE for ls in self.layers.values() for e in ls.owner)

    def slot_ids(self, layer: int, expert_ids: Tensor) -> Tensor:
        """Routed expert ids → slots, on the device (one gather, no sync)."""
        return self.layers[layer].slot_map[expert_ids]

    # ---- writers ------------------------------------------------------------------------
    def fill(self, layer: int, experts: list[int], load: Callable[[list[int], Mapping[str, Tensor]], None]) -> None:
        """Load `experts` into slots 0..n-1 (the rest stay free) with `load(experts, stacked dest)`."""
        ls = self.layers[layer]
        load(experts, ls.tensors)
        self.set_owners(layer, experts + [-1] * (self.capacity - len(experts)))

    def restore(self, layer: int, owner: list[int], tensors: Mapping[str, Tensor]) -> None:
        """Copy a snapshot's slot tensors into this layer's (addresses kept: CUDA graphs may hold them)."""
        ls = self.layers[layer]
        for name, t in ls.tensors.items():
            t.copy_(tensors[name])
        self.set_owners(layer, owner)

    def set_owners(self, layer: int, owner: list[int]) -> None:
        """Rebuild the host mirrors and the device slot map of one layer from slot → expert."""
        ls = self.layers[layer]
        ls.owner[:] = owner
        ls.where.clear()
        ls.where.update({e: s for s, e in enumerate(owner) if e >= 0})
        ls.slot_map.copy_(ls.host_map(self.num_experts))
        self._changed(layer)

    def install(self, layer: int, experts: list[int], victims: list[int], transfers: Transfers,
                wait: str = "host") -> Installed:
        """Copy `experts` over the slots of `victims` (resident experts) and update both maps.

        wait: "host" blocks until the copies land; "device" makes the compute stream wait for them
        (the host runs on); "none" hands the copies' event back (prefetch).
        """
        ls = self.layers[layer]
        slots = [ls.where.pop(v) for v in victims]
        t0 = time.perf_counter()
        copied, done = transfers.copy(layer, experts, [ls.views(s) for s in slots])
        transfers.wait(done, wait)
        waited = time.perf_counter() - t0   # host time on this install: reads (disk tier), queueing, waiting
        for e, s in zip(experts, slots):
            ls.owner[s] = e
            ls.where[e] = s
        self._update_map(layer, victims + experts, [-1] * len(victims) + slots)
        return Installed(copied, len(victims), waited, done if wait == "none" else None)

    def begin_install(self, layer: int, experts: list[int], victims: list[int], transfers: Transfers) -> tuple[Landing, int]:
        """Evict `victims` now and queue the copies of `experts` into their slots, without anyone
        waiting for them: until `finish_install`, the victims and the newcomers are both outside the
        bank and no map names those slots, so the steps in between run on (their misses are served
        from host RAM) while the copies land. Returns the landing and the bytes queued."""
        ls = self.layers[layer]
        slots = [ls.where.pop(v) for v in victims]
        for s in slots:
            ls.owner[s] = LANDING
        copied, done = transfers.copy(layer, experts, [ls.views(s) for s in slots])
        self._update_map(layer, victims, [-1] * len(victims))
        return Landing(layer, list(experts), slots, done), copied

    def finish_install(self, landing: Landing) -> None:
        """The landing's experts are resident from here on (the caller made sure the copies landed,
        or that the compute stream waits for them)."""
        ls = self.layers[landing.layer]
        for e, s in zip(landing.experts, landing.slots):
            ls.owner[s] = e
            ls.where[e] = s
        self._update_map(landing.layer, landing.experts, landing.slots)

    def _update_map(self, layer: int, experts: list[int], values: list[int]) -> None:
        ls = self.layers[layer]
        pin = self.device.type == "cuda"
        index = torch.tensor(experts, dtype=torch.long)
        value = torch.tensor(values, dtype=torch.int32)
        if pin:
            index, value = index.pin_memory(), value.pin_memory()
        ls.slot_map.index_put_((index.to(self.device, non_blocking=True),), value.to(self.device, non_blocking=True))
        self._changed(layer)

    def _changed(self, layer: int) -> None:
        self.layer_version[layer] += 1

    @property
    def version(self) -> int:
        """Changes of residency so far, all layers: maps derived from the bank know when to rebuild."""
        return sum(self.layer_version.values())
