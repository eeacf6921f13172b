"""The OpenAI APIs: Chat Completions, (legacy) Completions and Responses, streaming or not.

Each handler reads its request into messages + tools + sampling, runs a `Generation` and writes
its events in the API's wire format. The Responses API is served statelessly: every request
carries the whole conversation (`previous_response_id` and `store: true` are refused clearly).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from moestream.errors import InputError
from moestream.serve.chat import (custom_tool_names, namespaced_tool_names, openai_messages, openai_tools,
                                   responses_messages)
from moestream.serve.errors import bad_request, get
from moestream.serve.generation import Generation, KeepAlive, Outcome
from moestream.serve.state import ServerState, new_id
from moestream.serve.tool_calls import TextDelta, ToolArgumentsDelta, ToolCallEnd, ToolCallStart


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


SSE_KEEPALIVE = ": keep-alive\n\n"   # an SSE comment: every client skips it, every byte counts as activity


def _usage(out: Outcome) -> dict:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _tool_call_json(call, index: int | None = None) -> dict:
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
    return body if index is None else {"index": index, **body}


# ---- Chat Completions ----------------------------------------------------------------------------

def start_chat(state: ServerState, body: dict) -> tuple[Generation, bool, bool]:
    dropped: list[str] = []
    messages, tools = openai_messages(body), openai_tools(body, dropped)
    state.note_dropped(dropped)
    params = state.sampling(body, ("max_completion_tokens", "max_tokens"))
    ids = state.check_prompt(state.renderer.render(messages, tools))
    stream = bool(get(body, "stream", bool, False))
    options = get(body, "stream_options", dict) or {}
    return state.start(ids, params, tools), stream, bool(options.get("include_usage"))


async def chat_response(state: ServerState, gen: Generation, include_usage: bool = False) -> dict:
    out = await gen.run()
    message: dict = {"role": "assistant", "content": out.text if out.text or not out.calls else None}
    if out.calls:
        message["tool_calls"] = [_tool_call_json(c) for c in out.calls]
    return {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": out.reason}],
            "usage": _usage(out)}


async def chat_stream(state: ServerState, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    head = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": state.model_name, "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    async for e in gen.events():
        if isinstance(e, KeepAlive):
            yield SSE_KEEPALIVE
        elif isinstance(e, TextDelta):
            yield chunk({"content": e.text})
        elif isinstance(e, ToolCallStart):
            yield chunk({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                         "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, ToolArgumentsDelta):
            yield chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.json}}]})
    yield chunk({}, gen.outcome.reason)
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(gen.outcome)})
    yield sse("[DONE]")


# ---- Completions ---------------------------------------------------------------------------------

def start_completion(state: ServerState, body: dict) -> tuple[Generation, bool, bool]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if state.engine.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer files, so a text prompt cannot be encoded; send "
                              "token ids.", "prompt")
        try:
            ids = state.engine.encode(prompt) if prompt else []
        except InputError as exc:
            raise bad_request(str(exc), "prompt") from exc
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise bad_request("'prompt' must be one string or one array of token ids (batches of prompts are not "
                          "supported; send one request each).", "prompt")
    if get(body, "echo", bool) or get(body, "suffix", str) or (get(body, "best_of", int) or 1) != 1:
        raise bad_request("echo, suffix and best_of are not supported by this server.")
    params = state.sampling(body, ("max_tokens",))
    if body.get("max_tokens") is None:
        params.max_tokens = min(16, params.max_tokens)   # the Completions API's default
    ids = state.check_prompt(ids)
    stream = bool(get(body, "stream", bool, False))
    options = get(body, "stream_options", dict) or {}
    # vLLM's extension: the generated token ids, so a client can extend the conversation with exactly
    # the tokens the model produced (text does not always re-encode to them)
    token_ids = bool(get(body, "return_token_ids", bool, False))
    gen = state.start(ids, params, chat=False)
    gen.return_token_ids = token_ids
    return gen, stream, bool(options.get("include_usage"))


async def completion_response(state: ServerState, gen: Generation, include_usage: bool = False) -> dict:
    out = await gen.run()
    return {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.reason,
                         **({"token_ids": out.token_ids} if gen.return_token_ids else {})}],
            "usage": _usage(out)}


async def completion_stream(state: ServerState, gen: Generation, include_usage: bool) -> AsyncIterator[str]:
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    async for e in gen.events():
        if isinstance(e, KeepAlive):
            yield SSE_KEEPALIVE
        elif isinstance(e, TextDelta):
            yield sse({**head, "choices": [{"index": 0, "text": e.text, "logprobs": None, "finish_reason": None}]})
    last = {"index": 0, "text": "", "logprobs": None, "finish_reason": gen.outcome.reason}
    if gen.return_token_ids:   # all of them on the last chunk (the earlier ones carry none)
        last["token_ids"] = gen.outcome.token_ids
    yield sse({**head, "choices": [last]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": _usage(gen.outcome)})
    yield sse("[DONE]")


# ---- Responses -----------------------------------------------------------------------------------

def start_responses(state: ServerState, body: dict) -> tuple[Generation, bool, dict]:
    if body.get("previous_response_id"):
        raise bad_request("previous_response_id is not supported: this server keeps no responses; send the whole "
                          "conversation in 'input' (and store: false).", "previous_response_id")
    if body.get("store") is True:
        raise bad_request("store: true is not supported: this server keeps no responses; send store: false.", "store")
    dropped: list[str] = []
    messages, tools = responses_messages(body), openai_tools(body, dropped)
    state.note_dropped(dropped)
    params = state.sampling(body, ("max_output_tokens",))
    ids = state.check_prompt(state.renderer.render(messages, tools))
    gen = state.start(ids, params, tools)
    echo = {"_custom": custom_tool_names(body), "_namespaced": namespaced_tool_names(body), "instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": params.temperature, "top_p": params.top_p,
            "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}}, "reasoning": None, "store": False, "truncation": "disabled",
            "user": body.get("user")}
    return gen, bool(get(body, "stream", bool, False)), echo


class ResponseBuilder:
    """The response object and its output items, built as events arrive (both the streamed events
    and the final object come from here, so they agree by construction)."""

    def __init__(self, state: ServerState, echo: dict):
        echo = dict(echo)
        self.custom = echo.pop("_custom", set())   # tools whose calls are custom_tool_call items (raw text input)
        self.namespaced = echo.pop("_namespaced", {})   # flat name → (namespace, name) of namespaced functions
        self.body = {"id": new_id("resp_"), "object": "response", "created_at": int(time.time()),
                     "status": "in_progress", "model": state.model_name, "output": [], "error": None,
                     "incomplete_details": None, "usage": None, **echo}
        self.message: dict | None = None    # the open message item, while text streams into it
        self.calls: dict[int, dict] = {}    # open function_call items by tool-call index

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.body))

    def text(self, delta: str) -> list[tuple[str, dict]]:
        events = []
        if self.message is None:
            self.message = {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
                            "content": []}
            self.body["output"].append(self.message)
            index = len(self.body["output"]) - 1
            events.append(("response.output_item.added", {"output_index": index, "item": _copy(self.message)}))
            part = {"type": "output_text", "text": "", "annotations": []}
            self.message["content"].append(part)
            events.append(("response.content_part.added", {"item_id": self.message["id"], "output_index": index,
                                                           "content_index": 0, "part": _copy(part)}))
        self.message["content"][0]["text"] += delta
        events.append(("response.output_text.delta", {"item_id": self.message["id"], "output_index": self._index(self.message),
                                                      "content_index": 0, "delta": delta, "logprobs": []}))
        return events

    def close_text(self) -> list[tuple[str, dict]]:
        if self.message is None:
            return []
        m, index = self.message, self._index(self.message)
        self.message = None
        m["status"] = "completed"
        part = m["content"][0]
        return [("response.output_text.done", {"item_id": m["id"], "output_index": index, "content_index": 0,
                                               "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {"item_id": m["id"], "output_index": index, "content_index": 0,
                                                "part": _copy(part)}),
                ("response.output_item.done", {"output_index": index, "item": _copy(m)})]

    def call_start(self, e: ToolCallStart) -> list[tuple[str, dict]]:
        events = self.close_text()
        if e.name in self.custom:
            item = {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": e.id, "name": e.name, "input": "",
                    "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": new_id("fc_"), "call_id": e.id, "name": e.name, "arguments": "",
                    "status": "in_progress"}
            if e.name in self.namespaced:   # back under the names the client routes by
                item["namespace"], item["name"] = self.namespaced[e.name]
        self.body["output"].append(item)
        self.calls[e.index] = item
        events.append(("response.output_item.added", {"output_index": self._index(item), "item": _copy(item)}))
        return events

    def call_arguments(self, e: ToolArgumentsDelta) -> list[tuple[str, dict]]:
        item = self.calls[e.index]
        if item["type"] == "custom_tool_call":
            return []   # its raw input is known when the call ends
        item["arguments"] += e.json
        return [("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": self._index(item),
                                                            "delta": e.json})]

    def call_end(self, e: ToolCallEnd) -> list[tuple[str, dict]]:
        item = self.calls.pop(e.index)
        item["status"] = "completed"
        index = self._index(item)
        if item["type"] == "custom_tool_call":
            raw = e.call.arguments.get("input")
            item["input"] = raw if isinstance(raw, str) else e.call.arguments_json()
            return [("response.custom_tool_call_input.delta", {"item_id": item["id"], "output_index": index,
                                                              "delta": item["input"]}),
                    ("response.custom_tool_call_input.done", {"item_id": item["id"], "output_index": index,
                                                             "input": item["input"]}),
                    ("response.output_item.done", {"output_index": index, "item": _copy(item)})]
        return [("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                           "name": item["name"], "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": _copy(item)})]

    def finish(self, out: Outcome) -> list[tuple[str, dict]]:
        events = self.close_text()
        incomplete = out.reason == "length"
        self.body["status"] = "incomplete" if incomplete else "completed"
        self.body["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        self.body["usage"] = {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens,
                              "total_tokens": out.prompt_tokens + out.completion_tokens,
                              "input_tokens_details": {"cached_tokens": out.cached_tokens},
                              "output_tokens_details": {"reasoning_tokens": 0}}
        events.append(("response.incomplete" if incomplete else "response.completed", {"response": self.snapshot()}))
        return events

    def feed(self, e) -> list[tuple[str, dict]]:
        if isinstance(e, TextDelta):
            return self.text(e.text)
        if isinstance(e, ToolCallStart):
            return self.call_start(e)
        if isinstance(e, ToolArgumentsDelta):
            return self.call_arguments(e)
        if isinstance(e, ToolCallEnd):
            return self.call_end(e)
        return []

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.body["output"]) if it is item)


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


async def responses_result(state: ServerState, gen: Generation, echo: dict) -> dict:
    builder = ResponseBuilder(state, echo)
    async for e in gen.events():
        builder.feed(e)
    builder.finish(gen.outcome)
    return builder.body


async def responses_stream(state: ServerState, gen: Generation, echo: dict) -> AsyncIterator[str]:
    builder = ResponseBuilder(state, echo)
    number = 0

    def emit(kind: str, data: dict) -> str:
        nonlocal number
        number += 1
        return sse({"type": kind, "sequence_number": number - 1, **data}, event=kind)

    yield emit("response.created", {"response": builder.snapshot()})
    yield emit("response.in_progress", {"response": builder.snapshot()})
    async for e in gen.events():
        if isinstance(e, KeepAlive):   # Codex's idle timer counts events, not bytes: a comment is not enough
            yield emit("response.in_progress", {"response": builder.snapshot()})
        for kind, data in builder.feed(e):
            yield emit(kind, data)
    for kind, data in builder.finish(gen.outcome):
        yield emit(kind, data)
