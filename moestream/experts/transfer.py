"""Copies from the host tier into device slots, on their own stream, and the waits that go with them.

On CUDA every copy is queued on one copy stream (after the compute stream's work so far, or after
a given event) and ends with an event; the caller decides whether the host waits for it, the
compute stream waits for it, or nobody does yet (prefetch). On the CPU copies are plain reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

WAITS = ("host", "device", "none")


class Transfers:
    def __init__(self, tier, device: torch.device):
        self.tier, self.device = tier, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, layer: int, experts: list[int], dests: list[Mapping[str, Tensor]],
             after: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | None]:
        """Queue the copies of experts[i] into dests[i]; return bytes copied and a done event (CUDA)."""
        return self._queued(lambda: sum(self.tier.copy_into(layer, e, dest) for e, dest in zip(experts, dests)), after)

    def copy_rows(self, layer: int, experts: list[int], dest: Mapping[str, Tensor],
                  after: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | None]:
        """Queue the copies of experts[i] into row i of the stacked `dest` (runs of consecutive experts
        as one copy each, where the tier can); return bytes copied and a done event (CUDA)."""
        return self._queued(lambda: self.tier.copy_rows(layer, experts, dest), after)

    def _queued(self, issue: Callable[[], int], after: torch.cuda.Event | None) -> tuple[int, torch.cuda.Event | None]:
        """Run `issue` (it queues copies, returns their bytes) on the copy stream, after the compute
        stream's work so far or after `after`; on the CPU the copies are done when it returns."""
        if self.stream is None:
            return issue(), None
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            copied = issue()
            done = torch.cuda.Event()
            done.record()
        return copied, done

    def wait(self, done: torch.cuda.Event | None, how: str) -> None:
        """Wait for `done` as asked: the host ("host"), the compute stream ("device") or nobody ("none")."""
        if done is None or how == "none" or self.stream is None:   # on the CPU copies are done when queued
            return
        if how == "device":
            torch.cuda.current_stream(self.device).wait_event(done)
        else:
            done.synchronize()

    def synchronize(self) -> None:
        """Every queued copy has landed (snapshot save and restore)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
