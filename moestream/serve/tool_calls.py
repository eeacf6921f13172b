"""Turn a model's generated text back into structured tool calls, whole or while streaming.

Models emit tool calls as ``<tool_call>…</tool_call>`` blocks inside ordinary text; only the
body differs between families (JSON for Hermes/Qwen3, ``<function=…>`` XML for Qwen3-Coder).
So block finding, streaming and fallback live once in :class:`ToolCallParser`; a family only
reads one block's body, and a new family adds a subclass and one :data:`PARSERS` entry.

Rules shared by :meth:`ToolCallParser.parse` and :class:`ToolCallStream` (they always agree):

* A block runs from ``<tool_call>`` to the first ``</tool_call>`` after it.
* A block that does not parse, or is still open at the end, is plain text, character for
  character: the server must never lose what the model said, nor raise on it.
* Plain text is the text outside parsed blocks, whitespace as in the input, except that a
  whitespace-only remainder after the last parsed call is dropped (it is the model's newline
  before end-of-turn, not an answer).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field
from typing import Union

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _new_id() -> str:
    """OpenAI-style call id; made at parse time so each call can be answered by id."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=_new_id)

    def arguments_json(self) -> str:
        """The arguments as the OpenAI API sends them: a JSON string (unicode kept readable)."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class TextDelta:
    """Plain text, released as soon as it cannot be the start of a tool call."""
    text: str


@dataclass
class ToolCallStart:
    index: int  # 0, 1, … per parsed call in this generation
    id: str
    name: str


@dataclass
class ToolArgumentsDelta:
    index: int
    json: str  # concatenated per index: exactly ToolCall.arguments_json()


@dataclass
class ToolCallEnd:
    index: int
    call: ToolCall


Event = Union[TextDelta, ToolCallStart, ToolArgumentsDelta, ToolCallEnd]


class ToolCallParser:
    """One model family's tool-call format. Subclasses implement :meth:`parse_block` only."""

    name: str = ""

    def parse_block(self, body: str, tools: list[dict] | None) -> ToolCall | None:
        """The text between ``<tool_call>`` and ``</tool_call>`` → a call, or None if malformed."""
        raise NotImplementedError

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        """Whole text → (the plain text with the tool-call blocks removed, the calls)."""
        plain: list[str] = []
        calls: list[ToolCall] = []
        pos, after_last = 0, 0  # after_last: len(plain) right after the last parsed call
        while (start := text.find(OPEN, pos)) >= 0:
            end = text.find(CLOSE, start + len(OPEN))
            if end < 0:
                break
            plain.append(text[pos:start])
            call = self.parse_block(text[start + len(OPEN):end], tools)
            pos = end + len(CLOSE)
            if call is None:
                plain.append(text[start:pos])
            else:
                calls.append(call)
                after_last = len(plain)
        plain.append(text[pos:])
        if calls and not "".join(plain[after_last:]).strip():
            del plain[after_last:]
        return "".join(plain), calls

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream:
        """A fresh incremental parser for one generation."""
        return ToolCallStream(self, tools)


class ToolCallStream:
    """Incremental :meth:`ToolCallParser.parse`: feed deltas, get events as soon as they are sure.

    Text is released at once except a suffix that could still become ``<tool_call>``, so it
    streams with no visible delay. A block is buffered until ``</tool_call>`` and then emitted
    as Start, ArgumentsDelta (the whole JSON), End — or as TextDelta of its original text if it
    does not parse — so a call is never announced and then taken back.
    """

    def __init__(self, parser: ToolCallParser, tools: list[dict] | None = None):
        self._parser, self._tools = parser, tools
        self._buf, self._in_block, self._calls = "", False, 0
        self._scanned = 0  # in a block: CLOSE cannot start before this offset of _buf
        # Whitespace right after a call is held back: at finish() it is trailing and dropped.
        self._after_call, self._pending_ws = False, ""

    def push(self, delta: str) -> list[Event]:
        """Feed newly generated text; returns the events it makes certain."""
        events: list[Event] = []
        self._buf += delta
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE, max(self._scanned, len(OPEN)))
                if end < 0:
                    self._scanned = max(len(OPEN), len(self._buf) - len(CLOSE) + 1)
                    return events
                stop = end + len(CLOSE)
                block, self._buf = self._buf[:stop], self._buf[stop:]
                self._in_block = False
                self._block(block, events)
            else:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    self._text(self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return events
                self._text(self._buf[:start], events)
                if self._pending_ws:  # whitespace before a block is never trailing
                    events.append(TextDelta(self._pending_ws))
                self._pending_ws, self._after_call = "", False
                self._buf, self._in_block, self._scanned = self._buf[start:], True, 0

    def finish(self) -> list[Event]:
        """End of generation: an open block or a held tag prefix is plain text after all."""
        events: list[Event] = []
        self._text(self._buf, events)
        self._buf, self._in_block, self._pending_ws = "", False, ""
        return events

    def _block(self, block: str, events: list[Event]) -> None:
        call = self._parser.parse_block(block[len(OPEN):-len(CLOSE)], self._tools)
        if call is None:
            self._text(block, events)
            return
        i, self._calls = self._calls, self._calls + 1
        events += [ToolCallStart(i, call.id, call.name),
                   ToolArgumentsDelta(i, call.arguments_json()), ToolCallEnd(i, call)]
        self._after_call, self._pending_ws = True, ""

    def _text(self, text: str, events: list[Event]) -> None:
        if self._after_call and not text.strip():
            self._pending_ws += text
            return
        text, self._pending_ws, self._after_call = self._pending_ws + text, "", False
        if text:
            events.append(TextDelta(text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (0 if none)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"

    def parse_block(self, body: str, tools: list[dict] | None) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        args = {} if args is None else args
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        return ToolCall(obj["name"], args) if isinstance(args, dict) else None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(ToolCallParser):
    """``<function=NAME><parameter=KEY>raw text</parameter>…</function>`` (Qwen3-Coder).

    Values are raw text, so their JSON type comes from the tool's schema when it is known.
    """

    name = "qwen3_coder"

    def parse_block(self, body: str, tools: list[dict] | None) -> ToolCall | None:
        m = _FUNCTION.fullmatch(body)
        if m is None or not m.group(1).strip():
            return None
        name, inner = m.group(1).strip(), m.group(2)
        if _PARAMETER.sub("", inner).strip():  # stray text or an unclosed parameter
            return None
        props = _properties(tools, name)
        args = {}
        for key, raw in _PARAMETER.findall(inner):
            value = raw[1:] if raw.startswith("\n") else raw
            value = value[:-1] if value.endswith("\n") else value
            args[key.strip()] = _convert(value, props.get(key.strip(), {}).get("type"))
        return ToolCall(name, args)


def _properties(tools: list[dict] | None, name: str) -> dict:
    """The JSON-schema properties of tool ``name`` (OpenAI or Anthropic tool shape), or {}."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            schema = fn.get("parameters") or fn.get("input_schema") or {}
            props = schema.get("properties") if isinstance(schema, dict) else None
            return {k: v for k, v in props.items() if isinstance(v, dict)} if isinstance(
                props, dict) else {}
    return {}


def _convert(value: str, schema_type: str | list | None):
    """Raw parameter text → the schema's type; the text itself whenever that fails."""
    types = [t for t in (schema_type if isinstance(schema_type, list) else [schema_type])
             if isinstance(t, str)]
    s = value.strip()
    for t in types:
        if t == "string":
            return value
        if t in ("integer", "number") and re.fullmatch(r"[+-]?\d+", s):
            return int(s)
        if t == "number":
            try:
                x = float(s.replace("_", "#"))  # Python-only spellings such as 1_000 are text
            except ValueError:
                continue
            if math.isfinite(x):  # NaN/inf would make arguments_json() invalid JSON
                return x
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t in ("object", "array"):
            try:
                obj = json.loads(s)
            except ValueError:
                continue
            if isinstance(obj, dict if t == "object" else list):
                return obj
    if not {"integer", "number", "boolean", "object", "array"}.intersection(types) and s[:1] in ("{", "["):  # no usable schema: JSON-looking values are JSON
        try:
            return json.loads(s)
        except ValueError:
            pass
    return value


PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Qwen3CoderParser())}


def parser_for_template(chat_template: str | None) -> ToolCallParser:
    """Pick from the chat template text: '<function=' and '<parameter=' in it → qwen3_coder;
    else hermes (also for None), the format most chat templates with tools use."""
    if chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return PARSERS["qwen3_coder"]
    return PARSERS["hermes"]
