"""A sequence: one prompt and what has been generated for it, with its own sampling and stop state.

The scheduler moves a sequence WAITING → RUNNING (it holds a cache row) → FINISHED; the engine
appends each sampled token with `append`, which decides whether the sequence ends (end of
sequence, a stop string, max_tokens, the context) and queues what its reader should see: the
token and the newly complete text. Readers drain `outbox`; several readers of one engine each
read their own sequences, whoever advanced the engine.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from moestream.runtime.detokenize import IncrementalDetokenizer, StopStringFilter
from moestream.runtime.sampling import SamplingParams

_ids = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    tokenizer: object | None = None
    max_len: int = 0                     # the context: prompt + generated tokens may not exceed it
    generator: torch.Generator | None = None
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    row: int | None = None               # cache row while running
    tokens: list[int] = field(default_factory=list)   # generated tokens kept (EOS and stop tokens are not)
    sampled: int = 0                     # tokens sampled, EOS and stop tokens included
    finish_reason: str | None = None     # "eos" | "stop" | "length" | "cancelled"
    cached_tokens: int = 0               # prompt positions restored from the prefix cache, not prefilled
    prefilled: int = 0                   # prompt positions in the cache so far (restored or prefilled)
    resuming: bool = False               # preempted after sampling: its context goes in again, then it decodes on
    blocks: list[int] = field(default_factory=list)   # a paged cache's blocks holding its positions, in order
    sealed: int = 0                      # of those, the full ones keyed for prefix sharing
    block_key: bytes = b""               # the last sealed block's key
    outbox: deque = field(default_factory=deque)       # (token or None, text delta) for the reader

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=self.prompt) if self.tokenizer is not None else None
        self.stops = StopStringFilter(self.params.stop)

    @property
    def length(self) -> int:
        """Tokens in the cache once the last sampled token has been fed back."""
        return len(self.prompt) + self.sampled

    @property
    def last_token(self) -> int:
        return self._last

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prefilling(self) -> bool:
        """Admitted, and its prompt (or, resuming after preemption, its whole context) is still going
        into the cache (a chunk per step, `Scheduler.schedule`)."""
        return self.sampled == 0 or self.resuming

    @property
    def prefill_len(self) -> int:
        """How many positions must be in the cache before the sequence samples or decodes: the
        prompt, or resuming, the prompt and every sampled token but the last (the next decode step
        feeds that one)."""
        return len(self.prompt) + max(self.sampled - 1, 0)

    def prefill_ids(self) -> list[int]:
        """The ids of those positions."""
        return self.prompt if self.sampled == 0 else self.id_range(0, self.prefill_len)

    def id_range(self, start: int, end: int) -> list[int]:
        """The ids of positions start..end-1 of the context (prompt, then the kept sampled tokens)."""
        n = len(self.prompt)
        head = self.prompt[start:end] if start < n else []
        tail = self.tokens[max(start - n, 0):end - n] if end > n else []
        return head + tail

    @property
    def cached_len(self) -> int:
        """Positions the cache row holds now: what has been prefilled so far, or the prompt and every
        sampled token but the last (which is fed back by the next decode step)."""
        return self.prefilled if self.prefilling else len(self.prompt) + self.sampled - 1

    def cached_ids(self) -> list[int]:
        """The ids of those positions (every sampled token before the last was kept)."""
        return self.id_range(0, self.cached_len)

    def token_budget(self) -> int:
        return min(self.params.max_tokens, self.max_len - len(self.prompt))

    def append(self, token: int) -> None:
        """Record one sampled token, finish the sequence when it should end, and queue the output.

        The reader gets (token, text) for a kept token and (None, text) for the final flush of a
        sequence ended by EOS or a stop string."""
        self.sampled += 1
        self._last = token
        is_eos = token in self.eos_ids and not self.params.ignore_eos
        delta = ""
        if self.detok is not None and not is_eos:
            delta = self.stops.push(self.detok.add(token))
        if is_eos or self.stops.stopped or self.sampled >= self.token_budget():
            self.finish("eos" if is_eos else "stop" if self.stops.stopped else "length")
            delta += self.stops.flush()
            kept = None if is_eos or self.stops.stopped else token
        else:
            kept = token
        if kept is not None:
            self.tokens.append(kept)
        self.outbox.append((kept, delta))

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = self.finish_reason or reason
