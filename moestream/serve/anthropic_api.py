"""The Anthropic Messages API (what Claude Code speaks): messages, streaming events, token counting.

Fields a local server cannot honour but agents always send (`thinking`, `metadata`,
`cache_control` on blocks and tools, beta headers) are accepted and ignored. Usage follows the
API's split: `input_tokens` are the prompt tokens that were prefilled, `cache_read_input_tokens`
those restored from the prefix cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from moestream.serve.chat import anthropic_messages, anthropic_tools
from moestream.serve.errors import get
from moestream.serve.generation import Generation, KeepAlive, Outcome
from moestream.serve.openai_api import sse
from moestream.serve.state import ServerState, new_id
from moestream.serve.tool_calls import TextDelta, ToolArgumentsDelta, ToolCallEnd, ToolCallStart

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _render(state: ServerState, body: dict, dropped: list[str] | None = None) -> tuple[list[int], list[dict] | None]:
    messages, tools = anthropic_messages(body), anthropic_tools(body, dropped)
    return state.check_prompt(state.renderer.render(messages, tools)), tools


def start_messages(state: ServerState, body: dict) -> tuple[Generation, bool]:
    dropped: list[str] = []
    ids, tools = _render(state, body, dropped)
    state.note_dropped(dropped)
    params = state.sampling(body, ("max_tokens",), stop_field="stop_sequences", required_max=True)
    return state.start(ids, params, tools), bool(get(body, "stream", bool, False))


def count_tokens(state: ServerState, body: dict) -> dict:
    return {"input_tokens": len(_render(state, body)[0])}   # mid-conversation system turns included


def _stop(out: Outcome) -> tuple[str, str | None]:
    if out.stop_sequence is not None and out.reason == "stop":
        return "stop_sequence", out.stop_sequence
    return STOP_REASONS.get(out.reason, "end_turn"), None


def _usage(out: Outcome) -> dict:
    return {"input_tokens": out.prompt_tokens - out.cached_tokens, "output_tokens": out.completion_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0}


async def message_response(state: ServerState, gen: Generation) -> dict:
    out = await gen.run()
    content: list[dict] = [{"type": "text", "text": out.text}] if out.text else []   # as the stream has blocks
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in out.calls]
    reason, sequence = _stop(out)
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(out)}


async def message_stream(state: ServerState, gen: Generation) -> AsyncIterator[str]:
    """`message_start` waits for the prompt's prefix lookup, so its usage is the final split (pings
    keep the connection alive meanwhile: every Anthropic client skips them wherever they come)."""
    def event(kind: str, data: dict) -> str:
        return sse({"type": kind, **data}, event=kind)

    def start() -> str:
        return event("message_start", {"message": {
            "id": new_id("msg_"), "type": "message", "role": "assistant", "model": state.model_name, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {**_usage(gen.outcome), "output_tokens": 0}}})

    started = False
    index = -1
    text_open = False
    async for e in gen.events():
        if isinstance(e, KeepAlive):
            yield event("ping", {})
            continue
        if not started:
            started = True
            yield start()
        if isinstance(e, TextDelta):
            if not text_open:
                index += 1
                text_open = True
                yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": e.text}})
        elif isinstance(e, ToolCallStart):
            if text_open:
                yield event("content_block_stop", {"index": index})
                text_open = False
            index += 1
            yield event("content_block_start", {"index": index, "content_block": {"type": "tool_use", "id": e.id,
                                                                                "name": e.name, "input": {}}})
        elif isinstance(e, ToolArgumentsDelta):
            yield event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                          "partial_json": e.json}})
        elif isinstance(e, ToolCallEnd):
            yield event("content_block_stop", {"index": index})
    if not started:
        yield start()
    if text_open:
        yield event("content_block_stop", {"index": index})
    reason, sequence = _stop(gen.outcome)
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": _usage(gen.outcome)})
    yield event("message_stop", {})
