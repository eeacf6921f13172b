"""The engine worker: one thread steps the engine; HTTP handlers submit sequences and read events.

The engine is synchronous (a step decodes every running sequence by one token), the server is
asyncio. One owner bridges them: handlers `submit` a sequence (never blocking on a running step:
it goes through a queue the worker drains between steps) and await its events on an asyncio
queue the worker feeds after every step. Newcomers join the running batch at the next step
boundary (continuous batching: the scheduler admits them, the engine prefills them, decode
continues for the rest), and a cancelled sequence (the client went away) leaves at the next
step, its cache row freed. The queue of not-yet-admitted requests is bounded: beyond it a
request is refused at once (the server answers 429) instead of waiting without end.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from moestream.engine.engine import Engine
from moestream.runtime.sampling import SamplingParams
from moestream.runtime.sequence import Sequence

log = logging.getLogger("moestream.serve")


class QueueFull(Exception):
    """More requests wait than the server queues; the client should retry later."""


@dataclass(frozen=True)
class Token:
    token: int | None     # None for the final flush of a sequence ended by EOS or a stop string
    text: str


@dataclass(frozen=True)
class Admitted:
    """The sequence holds a batch place and its prompt's cached prefix is known (sent once, before
    its first token, as soon as the step that looked the prefix up has ended)."""
    cached_tokens: int


@dataclass(frozen=True)
class Finished:
    reason: str           # "eos" | "stop" | "length" | "cancelled"


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(eq=False)
class Request:
    """One submitted sequence and where its events go; the timestamps feed the metrics."""

    seq: Sequence
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    admitted: bool = False

    @property
    def done(self) -> bool:
        return self.seq.finished


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int = 256, metrics=None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self._intake: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._active: dict[int, Request] = {}
        self._queued = 0                      # submitted, not yet handed to the scheduler
        self._wake = threading.Event()
        self._count_lock = threading.Lock()
        self._stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None   # the server's event loop: events are delivered there
        self._thread = threading.Thread(target=self._loop, name="moestream-engine", daemon=True)

    # ---- handler side (any thread but the worker's) -----------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread.start()

    def submit(self, ids: list[int], params: SamplingParams, stop_ids: frozenset[int] = frozenset()) -> Request:
        """Queue a prompt; `stop_ids` end it like EOS (a chat template's end-of-turn token)."""
        if self._stopping:
            raise QueueFull("the server is shutting down")
        with self._count_lock:
            waiting = self._queued + len(self.engine.scheduler.waiting)
            if waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests are already waiting")
            self._queued += 1
        seq = self.engine.new_sequence(ids, params)
        if stop_ids:
            seq.eos_ids = seq.eos_ids | stop_ids
        request = Request(seq, asyncio.Queue(), self.loop)
        self._intake.put(request)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """The client went away: the sequence leaves the batch at the next step."""
        if not request.seq.finished:
            request.seq.finish("cancelled")
            self._wake.set()

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def waiting(self) -> int:
        return self._queued + len(self.engine.scheduler.waiting)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left and end the thread."""
        self._stopping = True
        for request in list(self._active.values()):
            self.cancel(request)
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker side ----------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._take_new()
            if self._stopping and not self._active:
                return
            if engine.scheduler.idle and not self._cancelled_pending():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            forwards, started = engine.counters.prefill_forwards, time.perf_counter()
            try:
                engine.step()
            except Exception as exc:   # one bad step must not take the server down: fail who was in it
                log.exception("engine step failed")
                self._fail_all(f"the engine failed: {exc}")
            if self.metrics is not None:
                self.metrics.step(time.perf_counter() - started, engine.counters.prefill_forwards > forwards)
            self._deliver()
            if self.metrics is not None:
                self.metrics.after_step(self)

    def _take_new(self) -> None:
        while True:
            try:
                request = self._intake.get_nowait()
            except queue.Empty:
                return
            self._active[request.seq.id] = request
            self.engine.add_sequence(request.seq)
            with self._count_lock:   # counted as waiting until the scheduler holds it
                self._queued -= 1

    def _cancelled_pending(self) -> bool:
        return any(r.seq.finished for r in self._active.values())

    def _deliver(self) -> None:
        now = time.perf_counter()
        for key, request in list(self._active.items()):
            seq = request.seq
            if not request.admitted and (seq.prefilled > 0 or seq.sampled > 0):
                request.admitted = True   # the prefix lookup has run: the prompt's cached/prefilled split is final
                request.loop.call_soon_threadsafe(request.events.put_nowait, Admitted(seq.cached_tokens))
            while seq.outbox:
                token, text = seq.outbox.popleft()
                if request.first_token is None:
                    request.first_token = now
                    if self.metrics is not None:
                        self.metrics.first_token(request)
                elif token is not None and self.metrics is not None:
                    self.metrics.inter_token(now - request.last_token)
                request.last_token = now
                request.loop.call_soon_threadsafe(request.events.put_nowait, Token(token, text))
            if seq.finished:
                request.loop.call_soon_threadsafe(request.events.put_nowait, Finished(seq.finish_reason or "stop"))
                del self._active[key]

    def _fail_all(self, message: str) -> None:
        for key, request in list(self._active.items()):
            request.seq.finish("error")
            self.engine.cancel(request.seq)   # leaves the batch, its row freed
            request.loop.call_soon_threadsafe(request.events.put_nowait, Failed(message))
            del self._active[key]
