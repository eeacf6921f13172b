"""The scheduler: which sequences run, in which cache rows, step by step.

Sequences wait in arrival order and are admitted between steps while fewer than `max_batch` run.
Running sequences always occupy cache rows 0..B-1 in order, so a decode step is one batch of the
first B rows and the CUDA graphs captured for batch size B serve whichever sequences run; when a
sequence finishes, the ones after it move up and `retire` says which rows to copy where. Admitted
sequences whose prompts are still being prefilled sit after the decoding ones and finish their
prefill in admission order, so the decoding sequences stay a prefix of the rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moestream.runtime.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_batch: int = 64):
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def admit(self, fits: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """Move waiting sequences into free rows (in arrival order, stopping at the first that `fits`
        refuses: a paged cache without the blocks for its prompt); returns the newly admitted ones."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if not seq.finished and fits is not None and not fits(seq):
                break
            self.waiting.popleft()
            if seq.finished:   # cancelled while waiting
                continue
            seq.status, seq.row = Status.RUNNING, len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def preempt(self) -> Sequence:
        """Send the newest running sequence back to the head of the queue (its cache blocks are
        needed by older ones); it holds the last row, so no other row moves."""
        seq = self.running.pop()
        seq.status, seq.row = Status.WAITING, None
        self.waiting.appendleft(seq)
        return seq

    def retire(self) -> list[tuple[int, int, int]]:
        """Drop finished sequences and move the others up; returns the row moves (src, dst, length)
        to apply to the cache, in an order that never overwrites a row before it has moved."""
        moves = []
        survivors = [s for s in self.running if not s.finished]
        for s in self.running:
            if s.finished:
                s.row = None
        for new_row, seq in enumerate(survivors):
            if seq.row != new_row:
                moves.append((seq.row, new_row, seq.cached_len))
                seq.row = new_row
        self.running = survivors
        return moves
