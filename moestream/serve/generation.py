"""One request's generation, as the APIs see it: text deltas and tool calls, then an outcome.

Every API handler does the same thing in its own wire format: submit the prompt to the worker,
read token events, pass the text through the tool-call parser (when the request has tools), and
finally report why generation ended and the token counts. This module is that common part; the
API modules only translate its events. Two more events keep a stream honest while nothing is
written: `Admitted` (the prompt has a batch place and its cached/prefilled split is final) and
`KeepAlive` (nothing was sent for the keep-alive interval: queued, prefilling, or a tool call
still being written), which each API turns into its own keep-alive. A reader that stops early
(the client disconnected, the stream was closed) cancels the sequence, so its batch place and
cache row are freed at the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from moestream.runtime.sampling import SamplingParams
from moestream.serve.errors import ApiError
from moestream.serve.tool_calls import TextDelta, ToolCall, ToolCallEnd, ToolCallParser
from moestream.serve.worker import Admitted, EngineWorker, Failed, Finished, QueueFull


class KeepAlive:
    """Nothing was sent for the keep-alive interval."""


KEEP_ALIVE = KeepAlive()


@dataclass
class Outcome:
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reason: str = "stop"                # "stop" | "length" | "tool_calls" | "cancelled"
    stop_sequence: str | None = None    # the stop string that ended the text, if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)   # the generated tokens kept (EOS and stop tokens are not)


class Generation:
    def __init__(self, worker: EngineWorker, ids: list[int], params: SamplingParams,
                 tools: list[dict] | None = None, parser: ToolCallParser | None = None, *,
                 stop_ids: frozenset[int] = frozenset(), user_stops: set[str] | None = None,
                 keepalive_s: float | None = None):
        """`user_stops`: the stop strings the client sent (a stop the server added, such as the end of
        turn, is not reported back); `keepalive_s`: yield `KEEP_ALIVE` after that long without an event."""
        self.user_stops = set(params.stop) if user_stops is None else user_stops
        try:
            self.request = worker.submit(ids, params, stop_ids)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry shortly.", headers={"Retry-After": "1"}) from exc
        self.worker = worker
        self.tools = tools
        self.stream = parser.stream(tools) if tools and parser is not None else None
        self.outcome = Outcome(prompt_tokens=len(ids))
        self.keepalive_s = keepalive_s
        self.admitted = False
        self.return_token_ids = False   # the API answer carries `token_ids` (the client asked, for exact follow-ups)

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first token (None before it)."""
        r = self.request
        return None if r.first_token is None else r.first_token - r.submitted

    def cancel(self) -> None:
        """The client went away: the sequence leaves the batch at the next step."""
        self.outcome.reason = "cancelled"
        self.worker.cancel(self.request)

    async def events(self) -> AsyncIterator[object]:
        """Admitted / KeepAlive / TextDelta / ToolCallStart / ToolArgumentsDelta / ToolCallEnd as
        generation goes; the outcome is complete when the iteration ends."""
        seq, out = self.request.seq, self.outcome
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        try:
            while True:
                event = await self._next(quiet_since)
                if event is None:
                    quiet_since = loop.time()
                    yield KEEP_ALIVE
                    continue
                if isinstance(event, Failed):
                    raise ApiError(500, event.message)
                if isinstance(event, Admitted):
                    self.admitted, out.cached_tokens = True, event.cached_tokens
                    yield event
                    continue
                if isinstance(event, Finished):
                    tail = self.stream.finish() if self.stream is not None else []
                    for e in self._account(tail):
                        yield e
                    out.reason = {"eos": "stop", "stop": "stop", "length": "length"}.get(event.reason, event.reason)
                    if out.calls and out.reason == "stop":
                        out.reason = "tool_calls"
                    matched = seq.stops.matched   # a stop the server added (end of turn) is not reported
                    out.stop_sequence = matched if matched in self.user_stops else None
                    break
                out.completion_tokens = seq.sampled
                out.cached_tokens = seq.cached_tokens
                if not event.text:
                    if seq.detok is None and event.token is not None:
                        quiet_since = loop.time()
                        yield TextDelta("")   # no tokenizer: one (empty) chunk per token still marks its arrival
                    continue
                produced = self.stream.push(event.text) if self.stream is not None else [TextDelta(event.text)]
                for e in self._account(produced):
                    quiet_since = loop.time()
                    yield e
            out.completion_tokens, out.cached_tokens = seq.sampled, seq.cached_tokens
            out.token_ids = list(seq.tokens)
        finally:
            if not seq.finished:
                self.cancel()

    async def _next(self, quiet_since: float):
        """The next worker event, or None once the keep-alive interval has passed without one."""
        queue = self.request.events
        if not queue.empty() or not self.keepalive_s:
            return queue.get_nowait() if not queue.empty() else await queue.get()
        left = quiet_since + self.keepalive_s - asyncio.get_running_loop().time()
        if left <= 0:
            return None
        try:
            return await asyncio.wait_for(queue.get(), left)
        except asyncio.TimeoutError:
            return None

    def _account(self, events: list) -> list:
        for e in events:
            if isinstance(e, TextDelta):
                self.outcome.text += e.text
            elif isinstance(e, ToolCallEnd):
                self.outcome.calls.append(e.call)
        return events

    async def run(self) -> Outcome:
        """Generate to the end (non-streaming requests)."""
        async for _ in self.events():
            pass
        return self.outcome
