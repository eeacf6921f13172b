"""From what each API sends to the prompt the model sees: one message form, one tool form, the template.

The three APIs describe a conversation differently (OpenAI Chat messages with `tool_calls` and
`tool` turns; Anthropic content blocks with `tool_use` / `tool_result`; OpenAI Responses items
with `function_call` / `function_call_output`). Each is read into the form chat templates take
(transformers' `apply_chat_template`): messages {role, content: str, tool_calls?, tool_call_id?}
with tool-call arguments as objects, and tools as {"type": "function", "function": {...}}.
Content the model cannot see (images, thinking blocks from another model, unknown block types)
is dropped with a debug log rather than refused: agents send such turns routinely.

A checkpoint without a chat template (the demo model) gets `FALLBACK_TEMPLATE`: ChatML that
renders tools the Qwen3 way, so tool calls come back in the Hermes `<tool_call>` form.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from moestream.serve.errors import bad_request, get

log = logging.getLogger("moestream.serve")

Message = dict[str, Any]

END_OF_TURN = "<|im_end|>"   # the fallback template's end of a turn (a stop string the server adds)

FALLBACK_TEMPLATE = (   # transformers renders with trim_blocks: every newline is written as an expression
    "{% set sys = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}{% if sys %}{{ sys + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% elif sys %}{{ '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{% for tc in m.tool_calls or [] %}"
    "{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (tc.function.name | tojson) + ', \"arguments\": ' }}"
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they parse (templates render objects), else as given."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw if raw is not None else {}


def _text_of(content: Any, where: str, text_types: tuple[str, ...] = ("text", "input_text", "output_text")) -> str:
    """The text of a content value: a string, or the text parts of a list of parts (others dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"the content of {where} must be a string or an array of parts.")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in text_types and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            log.debug("dropped a content part the model cannot see: %r", part.get("type") if isinstance(part, dict) else part)
    return "".join(texts)


def _tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}


# ---- tools -------------------------------------------------------------------------------------

def _function_tool(name: Any, description: Any, parameters: Any, where: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise bad_request(f"every tool needs a name ({where}).", "tools")
    fn: dict[str, Any] = {"name": name, "parameters": parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}}
    if isinstance(description, str):
        fn["description"] = description
    return {"type": "function", "function": fn}


# A custom (freeform) tool takes raw text, not JSON arguments: the model sees it as a function with
# one string parameter, and a call to it is answered as a `custom_tool_call` with that string.
CUSTOM_TOOL_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string", "description":
                          "the tool's whole input, as raw text in the format the description gives"}},
                          "required": ["input"]}


def _custom_description(tool: dict) -> str:
    text = tool.get("description") if isinstance(tool.get("description"), str) else ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        text += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return text


def custom_tool_names(body: dict) -> set[str]:
    """Names of the request's custom (freeform) tools, whose calls are answered as custom_tool_call items."""
    return {t["name"] for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "custom"
            and isinstance(t.get("name"), str)}


# A Responses `namespace` tool (Codex's sub-agent and MCP functions) groups functions under one name.
# The model sees each as one flat function `<namespace>__<name>`; its calls go back to the client as
# `function_call` items with `name` and `namespace` apart again, the way the client routes them.
NAMESPACE_SEPARATOR = "__"


def flat_tool_name(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def namespaced_tool_names(body: dict) -> dict[str, tuple[str, str]]:
    """The flat name of every function inside a namespace tool → (namespace, name)."""
    out = {}
    for tool in body.get("tools") or []:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for fn in tool.get("tools") or []:
                if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                    out[flat_tool_name(tool["name"], fn["name"])] = (tool["name"], fn["name"])
    return out


def _dropped(dropped: list[str] | None, what: str) -> None:
    log.debug("dropped a tool: %s", what)
    if dropped is not None:
        dropped.append(what)


def openai_tools(body: dict, dropped: list[str] | None = None) -> list[dict] | None:
    """The request's tools as the template takes them; each tool the model cannot call is named,
    with why, in `dropped` (hosted tools such as web_search run on OpenAI's servers, not here)."""
    tools = get(body, "tools", list)
    if not tools or body.get("tool_choice") == "none":
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise bad_request("'tools' must be an array of objects.", "tools")
        kind = tool.get("type", "function")
        if kind == "custom":   # Responses freeform tools (Codex's apply_patch): one string input
            out.append(_function_tool(tool.get("name"), _custom_description(tool), CUSTOM_TOOL_PARAMETERS, "tools"))
        elif kind == "namespace":
            space = tool.get("name")
            if not isinstance(space, str) or not space:
                raise bad_request("every namespace tool needs a name (tools).", "tools")
            for fn in tool.get("tools") or []:
                if not isinstance(fn, dict) or fn.get("type", "function") != "function":
                    _dropped(dropped, f"{space}.{fn.get('name') if isinstance(fn, dict) else fn} (not a function)")
                    continue
                described = " ".join(t for t in (tool.get("description"), fn.get("description")) if isinstance(t, str))
                out.append(_function_tool(flat_tool_name(space, str(fn.get("name") or "")), described or None,
                                          fn.get("parameters"), "tools"))
        elif kind == "function":
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool   # Chat nests, Responses does not
            out.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), "tools"))
        else:
            _dropped(dropped, f"{kind} (a hosted tool that runs on the provider's servers; this server cannot run it)")
    return out or None


def anthropic_tools(body: dict, dropped: list[str] | None = None) -> list[dict] | None:
    tools = get(body, "tools", list)
    choice = body.get("tool_choice")
    if not tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise bad_request("'tools' must be an array of objects.", "tools")
        if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
            _dropped(dropped, f"{tool.get('name') or tool.get('type')} (a server tool that runs on Anthropic's "
                              "servers; this server cannot run it)")
            continue
        out.append(_function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"), "tools"))
    return out or None


# ---- messages ----------------------------------------------------------------------------------

def openai_messages(body: dict) -> list[Message]:
    messages = get(body, "messages", list, required=True)
    if not messages:
        raise bad_request("'messages' must hold at least one message.", "messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'.", "messages")
        role = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}] has the unknown role {m['role']!r}.", "messages")
        msg: Message = {"role": role, "content": _text_of(m.get("content"), f"messages[{i}]")}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be an array.", "messages")
            msg["tool_calls"] = [_tool_call(str(c.get("id", "")), str((c.get("function") or {}).get("name", "")),
                                            (c.get("function") or {}).get("arguments")) for c in calls if isinstance(c, dict)]
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def anthropic_messages(body: dict) -> list[Message]:
    out: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = get(body, "messages", list, required=True)
    if not messages:
        raise bad_request("'messages' must hold at least one message.", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"messages.{i}.role must be 'user', 'assistant' or 'system'.", "messages")
        content = m.get("content")
        if m["role"] == "system":   # a mid-conversation instruction (string or text blocks)
            out.append({"role": "system", "content": _text_of(content, f"messages.{i}")})
            continue
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"messages.{i}.content must be a string or an array of content blocks.", "messages")
        texts, calls = [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append(_tool_call(str(block.get("id", "")), str(block.get("name", "")), block.get("input")))
            elif kind == "tool_result":
                if texts:   # text before a result stays before it
                    out.append({"role": m["role"], "content": "".join(texts)})
                    texts = []
                result = _text_of(block.get("content"), f"messages.{i} tool_result")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": str(block.get("tool_use_id", ""))})
            else:
                log.debug("dropped a content block the model cannot see: %r", kind)
        if texts or calls:
            msg: Message = {"role": m["role"], "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def responses_messages(body: dict) -> list[Message]:
    out: list[Message] = []
    instructions = get(body, "instructions", str)
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty array of items.", "input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"input[{i}] has the unknown role {item.get('role')!r}.", "input")
            out.append({"role": role, "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            space = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            call = _tool_call(str(item.get("call_id", "")), flat_tool_name(space, str(item.get("name", ""))),
                              item.get("arguments"))
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "custom_tool_call":
            call = _tool_call(str(item.get("call_id", "")), str(item.get("name", "")), {"input": str(item.get("input", ""))})
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"input[{i}].output") if isinstance(output, list) else json.dumps(output)
            out.append({"role": "tool", "content": text, "tool_call_id": str(item.get("call_id", ""))})
        else:
            log.debug("dropped an input item the model cannot see: %r", kind)
    return out


# ---- the prompt --------------------------------------------------------------------------------

class PromptRenderer:
    """Messages and tools → token ids, through the checkpoint's chat template (or the fallback).

    Two facts about the template are read once, by rendering probe conversations: whether it
    shows a system turn in mid-conversation (else such turns are folded into the next user
    turn), and the text that ends an assistant turn (a stop, in case the tokenizer's EOS is
    something else)."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer = tokenizer   # None: a checkpoint without tokenizer files (token-id completions only)
        self.template = template or getattr(tokenizer, "chat_template", None) or None
        self.uses_fallback = tokenizer is not None and self.template is None
        self.system_turns = tokenizer is None or self._shows_mid_system_turns()
        self.end_of_turn: str | None = None       # the end-of-turn text, as a stop string
        self.end_of_turn_id: int | None = None    # or, when it is one special token, its id
        if tokenizer is not None:
            self._find_end_of_turn()

    def render(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer files, so messages cannot be rendered; use "
                              "/v1/completions with a prompt of token ids.")
        return self.encode(self._apply(self.arrange(messages), tools))

    def encode(self, text: str) -> list[int]:
        """Text already holding its special tokens: no BOS or other tokens are added."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def arrange(self, messages: list[Message]) -> list[Message]:
        """System turns where the template takes them: the leading ones merged into one system
        prompt; later ones kept as system turns if the template shows them, else folded into the
        next user turn (or, with none after, the last one)."""
        out: list[Message] = []
        folded: list[str] = []
        leading = True
        for m in messages:
            if m["role"] == "system":
                if not m["content"]:
                    continue
                if leading and out:
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
                elif leading or self.system_turns:
                    out.append(m)
                else:
                    folded.append(m["content"])
                continue
            leading = False
            if folded and m["role"] == "user":
                m = {**m, "content": "\n\n".join(folded + [m["content"]])}
                folded = []
            out.append(m)
        if folded:
            last = next((i for i in range(len(out) - 1, -1, -1) if out[i]["role"] == "user"), None)
            if last is None:
                out.append({"role": "user", "content": "\n\n".join(folded)})
            else:
                out[last] = {**out[last], "content": "\n\n".join([out[last]["content"]] + folded)}
        return out

    def _apply(self, messages: list[Message], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False, chat_template=self.template or FALLBACK_TEMPLATE)

    def _shows_mid_system_turns(self) -> bool:
        probe = "moestream system probe"
        try:
            text = self._apply([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                {"role": "assistant", "content": "a"}, {"role": "system", "content": probe},
                                {"role": "user", "content": "v"}])
        except Exception:   # templates that insist on alternating roles raise
            return False
        return probe in text

    def _find_end_of_turn(self) -> None:
        reply = "moestream reply probe"
        try:
            text = self._apply([{"role": "user", "content": "u"}, {"role": "assistant", "content": reply}],
                               generation_prompt=False)
        except Exception:
            return
        at = text.rfind(reply)
        tail = text[at + len(reply):].split() if at >= 0 else []
        if not tail:
            return
        mark = tail[0]
        vocab = self.tokenizer.get_added_vocab() if hasattr(self.tokenizer, "get_added_vocab") else {}
        if mark in vocab:   # one special token: the detokenizer never shows it as text, so stop on its id
            self.end_of_turn_id = int(vocab[mark])
        elif re.fullmatch(r"[<\[].{1,30}[>\]]", mark):   # a marker such as <|im_end|> spelled in ordinary tokens
            self.end_of_turn = mark
