"""One request's generation, as the APIs see it: text deltas and tool calls, then an outcome.

Every API handler does the same thing in its own wire format: submit the prompt to the worker,
read token events, pass the text through the tool-call parser (when the request has tools), and
finally report why generation ended and the token counts. This module is that common part; the
API modules only translate its events. A reader that stops early (the client disconnected, the
stream was closed) cancels the sequence, so its batch place and cache row are freed at the next
step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from moestream.runtime.sampling import SamplingParams
from moestream.serve.chat import END_OF_TURN
from moestream.serve.errors import ApiError
from moestream.serve.tool_calls import TextDelta, ToolCall, ToolCallEnd, ToolCallParser
from moestream.serve.worker import EngineWorker, Failed, Finished, QueueFull

DISCONNECT_POLL_S = 0.25   # how often a non-streaming request checks that its client is still there


@dataclass
class Outcome:
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reason: str = "stop"                # "stop" | "length" | "tool_calls" | "cancelled"
    stop_sequence: str | None = None    # the stop string that ended the text, if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generation:
    def __init__(self, worker: EngineWorker, ids: list[int], params: SamplingParams,
                 tools: list[dict] | None = None, parser: ToolCallParser | None = None):
        try:
            self.request = worker.submit(ids, params)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}); retry shortly.", headers={"Retry-After": "1"}) from exc
        self.worker = worker
        self.tools = tools
        self.stream = parser.stream(tools) if tools and parser is not None else None
        self.outcome = Outcome(prompt_tokens=len(ids))
        self.user_stops = set(params.stop) - {END_OF_TURN}

    async def events(self, disconnected: Callable[[], object] | None = None) -> AsyncIterator[object]:
        """TextDelta / ToolCallStart / ToolArgumentsDelta / ToolCallEnd as generation goes; the
        outcome is complete when the iteration ends. `disconnected` (an async check) is polled
        while waiting, for requests whose client going away is not otherwise noticed."""
        seq, out = self.request.seq, self.outcome
        try:
            while True:
                event = await self._next(disconnected)
                if isinstance(event, Failed):
                    raise ApiError(500, event.message)
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
                        yield TextDelta("")   # no tokenizer: one (empty) chunk per token still marks its arrival
                    continue
                produced = self.stream.push(event.text) if self.stream is not None else [TextDelta(event.text)]
                for e in self._account(produced):
                    yield e
            out.completion_tokens, out.cached_tokens = seq.sampled, seq.cached_tokens
        finally:
            self.worker.cancel(self.request)   # a no-op once finished

    async def _next(self, disconnected):
        queue = self.request.events
        if disconnected is None:
            return await queue.get()
        while True:
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await disconnected():
                    self.worker.cancel(self.request)
                    raise asyncio.CancelledError("the client disconnected") from None

    def _account(self, events: list) -> list:
        for e in events:
            if isinstance(e, TextDelta):
                self.outcome.text += e.text
            elif isinstance(e, ToolCallEnd):
                self.outcome.calls.append(e.call)
        return events

    async def run(self, disconnected: Callable[[], object] | None = None) -> Outcome:
        """Generate to the end (non-streaming requests)."""
        async for _ in self.events(disconnected):
            pass
        return self.outcome
