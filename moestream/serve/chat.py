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


def openai_tools(body: dict) -> list[dict] | None:
    tools = get(body, "tools", list)
    if not tools or body.get("tool_choice") == "none":
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise bad_request("'tools' must be an array of objects.", "tools")
        if tool.get("type") == "custom":   # Responses freeform tools (Codex's apply_patch): one string input
            out.append(_function_tool(tool.get("name"), _custom_description(tool), CUSTOM_TOOL_PARAMETERS, "tools"))
            continue
        if tool.get("type", "function") != "function":
            log.debug("dropped a non-function tool: %r", tool.get("type"))
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool   # Chat nests, Responses does not
        out.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), "tools"))
    return out or None


def anthropic_tools(body: dict) -> list[dict] | None:
    tools = get(body, "tools", list)
    choice = body.get("tool_choice")
    if not tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise bad_request("'tools' must be an array of objects.", "tools")
        if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
            log.debug("dropped a server tool: %r", tool.get("type"))
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
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"messages.{i}.role must be 'user' or 'assistant'.", "messages")
        content = m.get("content")
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
            call = _tool_call(str(item.get("call_id", "")), str(item.get("name", "")), item.get("arguments"))
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
    """Messages and tools → token ids, through the checkpoint's chat template (or the fallback)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer   # None: a checkpoint without tokenizer files (token-id completions only)
        self.template = getattr(tokenizer, "chat_template", None) or None
        self.uses_fallback = tokenizer is not None and self.template is None

    def render(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this checkpoint has no tokenizer files, so messages cannot be rendered; use "
                              "/v1/completions with a prompt of token ids.")
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                  chat_template=self.template or FALLBACK_TEMPLATE)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Text already holding its special tokens: no BOS or other tokens are added."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
