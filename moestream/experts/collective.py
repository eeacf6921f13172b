"""What the expert-parallel all-reduce costs one rank: calls, bytes and time, measured off the hot path.

On gloo the reduce runs on the host, so a host timer around the call measures it (with CUDA
tensors that includes gloo waiting for the layer's queued GPU work before it can copy the partial
out). On NCCL the call only queues work on the GPU: CUDA events are recorded around it and read
when the figures are asked for, never with a sync per layer. A call captured into a CUDA graph
runs at every replay, where the host sees nothing: replays are counted by the runner
(`graph_replayed`) and their calls and bytes added, but not timed (`graph_calls`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

_PENDING_LIMIT = 4096   # event pairs kept before finished ones are folded in (without waiting)


class CollectiveStats:
    """Counters of one rank's all-reduces (`run` wraps each one)."""

    def __init__(self, device: torch.device, events: bool):
        """`events`: time with CUDA events read lazily (NCCL); else with the host clock (gloo)."""
        self.device, self.events = device, events
        self.calls = self.bytes = self.graph_calls = 0
        self.seconds = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[torch.cuda.Event] = []
        self._graph_rows: dict[int, int] = {}   # bytes per token row of each layer's reduce, as captured

    def run(self, layer: int, reduce: Callable[[Tensor], None], tensor: Tensor) -> None:
        """Reduce `tensor` in place with `reduce`, counted (and timed unless captured into a graph)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.events and torch.cuda.is_current_stream_capturing():
            self._graph_rows[layer] = nbytes // max(tensor.shape[0], 1)   # runs at each replay, not now
            reduce(tensor)
            return
        self.calls += 1
        self.bytes += nbytes
        if not self.events:
            t0 = time.perf_counter()
            reduce(tensor)
            self.seconds += time.perf_counter() - t0
            return
        start, end = self._event(), self._event()
        start.record()
        reduce(tensor)
        end.record()
        self._pending.append((start, end))
        if len(self._pending) > _PENDING_LIMIT:
            self._fold(wait=False)

    def graph_replayed(self, rows: int) -> None:
        """One whole-step graph replay of `rows` token rows ran every captured reduce once."""
        for row_bytes in self._graph_rows.values():
            self.graph_calls += 1
            self.calls += 1
            self.bytes += row_bytes * rows

    def as_dict(self) -> dict:
        """The figures so far (folds in every timed reduce: waits for the last one queued)."""
        self._fold(wait=True)
        return {"calls": self.calls, "bytes": self.bytes, "seconds": self.seconds, "graph_calls": self.graph_calls}

    def reset(self) -> None:
        self._fold(wait=True)
        self.calls = self.bytes = self.graph_calls = 0
        self.seconds = 0.0

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def _fold(self, wait: bool) -> None:
        if wait and self._pending:
            self._pending[-1][1].synchronize()   # events complete in stream order
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            self.seconds += start.elapsed_time(end) / 1e3
            self._free += (start, end)
