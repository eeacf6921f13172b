"""What coding agents (Claude Code, Codex, opencode, aider) need from the server, through the official
`anthropic` and `openai` clients: system turns anywhere, keep-alives while nothing is generated, a
client leaving at any time, the server's output cap, the template's end of turn, usage that agrees
from the first event to the last, Codex's namespaced tools, and the access log."""

from __future__ import annotations

import copy
import json
import logging
import threading
import time

import httpx
import openai
import pytest

from conftest import Server, wait_until
from moestream.engine.engine import Engine
from moestream.serve.app import ServeOptions, create_app
from moestream.serve.chat import PromptRenderer, openai_tools, responses_messages

# A checkpoint's own ChatML template that refuses a system turn after the first (as Mistral's and
# Gemma's templates do) and whose end of turn, <|im_end|>, the demo tokenizer spells in plain tokens.
STRICT_CHATML = (
    "{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise_exception('System messages must come first.') }}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CAP = 24                  # the strict server's --max-tokens
KEEPALIVE_S = 0.05        # the strict server's keep-alive interval


@pytest.fixture(scope="module")
def strict(demo_engine):
    """A second server on the demo engine: its own template, a small output cap, fast keep-alives."""
    srv = Server(create_app(lambda: demo_engine, ServeOptions(model_name="demo", max_tokens=CAP,
                                                              keepalive_s=KEEPALIVE_S, chat_template=STRICT_CHATML)),
                 demo_engine)
    srv.wait_ready()
    yield srv
    srv.stop()


def clients(srv):
    import anthropic   # here, not at collection: its import takes ~3 s, in every worker that collects

    return (openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0))


@pytest.fixture
def slow(demo_engine, monkeypatch):
    """slow(marker, first=s, each=s): sequences whose prompt contains `marker` wait `first` seconds
    before their first token and `each` before every token; returns the sequences seen."""
    rules: dict[str, tuple[float, float]] = {}
    seen: dict[int, object] = {}
    sample = Engine._sample

    def slowed(self, seqs, logits):
        for seq in seqs:
            prompt = demo_engine.tokenizer.decode(seq.prompt)
            for marker, (first, each) in rules.items():
                if marker in prompt:
                    seen[seq.id] = seq
                    time.sleep((first if seq.sampled == 0 else 0.0) + each)
        return sample(self, seqs, logits)

    monkeypatch.setattr(Engine, "_sample", slowed)

    def add(marker: str, first: float = 0.0, each: float = 0.0) -> dict:
        rules[marker] = (first, each)
        return seen
    return add


def metric(srv, line_start: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    return values[0] if values else 0.0


def sse_events(response) -> list[tuple[str | None, str]]:
    """(event name, data) of a raw SSE body; a comment line is ("comment", text)."""
    out, name = [], None
    for line in response.iter_lines():
        if line.startswith(":"):
            out.append(("comment", line[1:].strip()))
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            out.append((name, line[5:].strip()))
            name = None
    return out


# ---- system turns anywhere ---------------------------------------------------------------------

def test_a_mid_conversation_system_message_is_answered_and_counted(server, strict, force):
    force("SYSMARK", "Understood.")
    for srv in (server, strict):   # one template shows system turns mid-way, the other refuses them
        _, claude = clients(srv)
        messages = [{"role": "user", "content": "hi"},
                    {"role": "system", "content": [{"type": "text", "text": "SYSMARK Reply in English."}]}]
        m = claude.messages.create(model="m", max_tokens=8, system="Be terse.", messages=messages)
        assert m.content[0].text == "Understood."   # the system text reached the prompt
        counted = claude.messages.count_tokens(model="m", system="Be terse.", messages=messages).input_tokens
        assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
        assert counted > claude.messages.count_tokens(model="m", system="Be terse.", messages=messages[:1]).input_tokens
    assert server.state.renderer.system_turns and not strict.state.renderer.system_turns
    # The strict template gets it folded into the user turn after it (or, with none after, the last one).
    text = strict.engine.tokenizer.decode(strict.state.renderer.render(
        [{"role": "system", "content": "A."}, {"role": "system", "content": "B."},
         {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
         {"role": "system", "content": "C."}, {"role": "user", "content": "u2"}]))
    assert "<|im_start|>system\nA.\n\nB.<|im_end|>" in text and "<|im_start|>user\nC.\n\nu2<|im_end|>" in text


def test_several_developer_messages_in_chat_and_responses(strict, force):
    force("DEVMARK", "Fine.")
    oai, _ = clients(strict)
    chat = oai.chat.completions.create(model="m", max_tokens=6, messages=[
        {"role": "developer", "content": "Rule one."}, {"role": "developer", "content": "DEVMARK rule two."},
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "Rule three."}, {"role": "user", "content": "again"}])
    assert chat.choices[0].message.content == "Fine."
    r = oai.responses.create(model="codex", max_output_tokens=6, instructions="Be brief.", input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"role": "developer", "content": "DEVMARK Approvals: never."},
        {"role": "user", "content": "hello"}])
    assert r.output_text == "Fine."


# ---- keep-alives ---------------------------------------------------------------------------------

def test_streams_send_keepalives_while_waiting_for_the_first_token(strict, slow, force):
    force("KEEPMARK", "Here you are.")
    slow("KEEPMARK", first=20 * KEEPALIVE_S)
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "KEEPMARK"}]}
    with httpx.stream("POST", f"{strict.url}/v1/messages", json=body, timeout=30) as r:
        events = sse_events(r)
    names = [name for name, _ in events]
    assert names.index("ping") < names.index("message_start") < names.index("content_block_delta")
    with httpx.stream("POST", f"{strict.url}/v1/chat/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    first_text = next(i for i, (_, data) in enumerate(events) if '"content": "H' in data)
    assert ("comment", "keep-alive") in events[:first_text]
    oai, claude = clients(strict)
    chunks = list(oai.chat.completions.create(model="m", max_tokens=8, stream=True, messages=body["messages"]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Here you are."
    with oai.responses.stream(model="codex", input="KEEPMARK", max_output_tokens=8) as stream:
        kinds = [e.type for e in stream]
    assert kinds.count("response.in_progress") >= 2                   # the repeats Codex's idle timer needs
    assert kinds.index("response.output_text.delta") > kinds.index("response.in_progress")
    with claude.messages.stream(model="m", max_tokens=8, messages=body["messages"]) as stream:
        assert stream.get_final_message().content[0].text == "Here you are."   # pings are invisible to clients


def test_queue_gauges_move_and_metrics_answer_while_a_step_is_long(strict, demo_engine, monkeypatch):
    gate, inside = threading.Event(), threading.Event()
    sample = Engine._sample

    def held(self, seqs, logits):   # a long prefill: the step holds the engine until released
        if any(s.sampled == 0 and len(s.prompt) > 40 for s in seqs):
            inside.set()
            gate.wait(30)
        return sample(self, seqs, logits)

    monkeypatch.setattr(Engine, "_sample", held)
    oai, _ = clients(strict)
    done = []
    worker = threading.Thread(target=lambda: done.append(oai.completions.create(
        model="m", prompt=list(range(100, 160)), max_tokens=2)))
    worker.start()
    try:
        assert inside.wait(30)
        assert metric(strict, "moestream_running_sequences") == 1   # answered while the engine is busy
    finally:
        gate.set()
        worker.join(30)
    assert done and done[0].usage.completion_tokens == 2


# ---- a client that leaves ----------------------------------------------------------------------

def test_a_disconnected_non_streaming_request_is_cancelled_logged_once_and_counted(strict, slow, caplog):
    seen = slow("LEAVEMARK", each=0.1)
    before = metric(strict, 'moestream_requests_total{api="completions",status="499"}')
    caplog.set_level(logging.INFO, logger="moestream.serve")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{strict.url}/v1/completions", timeout=1.0,
                   json={"model": "m", "prompt": "LEAVEMARK once upon", "max_tokens": CAP, "ignore_eos": True})
    wait_until(lambda: metric(strict, 'moestream_requests_total{api="completions",status="499"}') == before + 1)
    (seq,) = seen.values()
    assert seq.finish_reason == "cancelled" and seq.sampled < CAP   # stopped, not generated to the end
    lines = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(lines) == 1 and " 499 " in lines[0].getMessage() and "/v1/completions" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]   # no traceback
    wait_until(lambda: strict.state.worker.running == 0)


def test_a_stream_closed_early_is_counted_as_499(strict, slow, caplog):
    slow("LEAVESTREAM", each=0.3)   # the cap is a few tokens: leave the server time to see the client go
    caplog.set_level(logging.INFO, logger="moestream.serve")
    before = metric(strict, 'moestream_requests_total{api="chat",status="499"}')
    body = {"model": "m", "stream": True, "ignore_eos": True, "messages": [{"role": "user", "content": "LEAVESTREAM"}]}
    with httpx.stream("POST", f"{strict.url}/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break
    wait_until(lambda: metric(strict, 'moestream_requests_total{api="chat",status="499"}') == before + 1)
    assert len([r for r in caplog.records if "disconnected" in r.getMessage()]) == 1
    wait_until(lambda: strict.state.worker.running == 0)


def test_a_client_that_leaves_during_a_long_prefill_frees_the_engine_within_a_chunk(strict, demo_engine, monkeypatch):
    """A prompt is prefilled a chunk a step and the stream's keep-alives notice a client that left, so
    a streaming request abandoned during its prefill costs at most the chunk in flight, and the next
    request is served (asserted by the engine's chunk count, not by time)."""
    monkeypatch.setattr(demo_engine.scheduler, "prefill_chunk", 32)
    prefill = demo_engine.runner.prefill

    def slowed(*args, **kwargs):
        time.sleep(0.15)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(demo_engine.runner, "prefill", slowed)
    text = "LEAVEPREFILL " + "total = total + 1\n" * 48
    prompt_tokens = len(demo_engine.tokenizer.encode(text))
    chunks_needed = -(-prompt_tokens // 32)
    assert chunks_needed >= 8
    _, client = clients(strict)
    before = demo_engine.counters.prefill_chunks
    stream = client.messages.create(model="m", max_tokens=4, stream=True,
                                    messages=[{"role": "user", "content": text}])
    wait_until(lambda: demo_engine.counters.prefill_chunks - before >= 2)
    stream.close()   # the client leaves two chunks into a prompt of many
    wait_until(lambda: strict.state.worker.running == 0)
    done = demo_engine.counters.prefill_chunks - before
    assert done < chunks_needed - 2, f"{done} of {chunks_needed} chunks were prefilled for a client that left"
    reply = client.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.output_tokens >= 1                      # the engine is free for the next request


# ---- output cap, end of turn, usage ---------------------------------------------------------------

def test_the_server_cap_is_the_default_and_the_ceiling(strict, force):
    force("CAPMARK", " ".join(["word"] * (2 * CAP)))
    oai, claude = clients(strict)
    messages = [{"role": "user", "content": "CAPMARK"}]
    none_sent = oai.chat.completions.create(model="m", messages=messages)
    assert none_sent.usage.completion_tokens == CAP and none_sent.choices[0].finish_reason == "length"
    asked_more = claude.messages.create(model="m", max_tokens=16000, messages=messages)
    assert asked_more.usage.output_tokens == CAP and asked_more.stop_reason == "max_tokens"
    r = oai.responses.create(model="codex", input="CAPMARK")
    assert r.usage.output_tokens == CAP and r.status == "incomplete"
    fewer = oai.chat.completions.create(model="m", messages=messages, max_tokens=5)
    assert fewer.usage.completion_tokens == 5


def test_a_reply_stops_at_the_templates_end_of_turn(strict, force):
    assert not strict.state.renderer.uses_fallback and strict.state.renderer.end_of_turn == "<|im_end|>"
    assert "<|im_end|>" not in strict.engine.tokenizer.all_special_tokens   # the tokenizer's EOS is another
    force("EOTMARK", "All done.<|im_end|>\nand then more text")
    oai, claude = clients(strict)
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "EOTMARK"}], max_tokens=20)
    assert r.choices[0].message.content == "All done." and r.choices[0].finish_reason == "stop"
    m = claude.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "EOTMARK"}])
    assert m.content[0].text == "All done." and m.stop_reason == "end_turn" and m.stop_sequence is None


def test_an_end_of_turn_special_token_stops_by_id(demo_engine):
    tokenizer = copy.deepcopy(demo_engine.tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    renderer = PromptRenderer(tokenizer, STRICT_CHATML)
    assert renderer.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>") and renderer.end_of_turn is None


def test_message_start_reports_the_final_usage_split(server, force):
    force("USAGEMARK", "Some reply text here.")
    _, claude = clients(server)
    messages = [{"role": "user", "content": "USAGEMARK " + "a long shared prefix " * 12}]
    for turn in range(2):   # the second turn reuses the first one's prefix
        events = list(claude.messages.create(model="m", max_tokens=6, messages=messages, stream=True))
        start = events[0].message.usage
        end = [e for e in events if e.type == "message_delta"][0].usage
        assert events[0].type == "message_start"
        assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
        assert (start.cache_read_input_tokens > 0) == (turn == 1)


# ---- Codex's namespaced tools ------------------------------------------------------------------

NAMESPACE = {"type": "namespace", "name": "collab", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
                        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}


def test_namespaced_tools_reach_the_template_and_calls_come_back_namespaced(server, force, caplog):
    caplog.set_level(logging.INFO, logger="moestream.serve")
    force("NSMARK", '<tool_call>\n{"name": "collab__spawn_agent", "arguments": {"task": "lint"}}\n</tool_call>')
    tools = [NAMESPACE, {"type": "web_search"}]
    body = {"model": "codex", "input": "NSMARK", "tools": tools, "max_output_tokens": 60}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60).json()
    (call,) = [item for item in r["output"] if item["type"] == "function_call"]
    assert call["name"] == "spawn_agent" and call["namespace"] == "collab" and json.loads(call["arguments"]) == {"task": "lint"}
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}, timeout=60) as s:
        done = [json.loads(data) for name, data in sse_events(s) if name == "response.output_item.done"]
    assert done[-1]["item"]["namespace"] == "collab" and done[-1]["item"]["name"] == "spawn_agent"
    assert any("web_search" in rec.getMessage() and "cannot run" in rec.getMessage() for rec in caplog.records)
    # The template sees one flat function, and the call in the history under the same flat name.
    history = {"input": [{"role": "user", "content": "NSMARK"},
                         {"type": "function_call", "call_id": call["call_id"], "name": "spawn_agent",
                          "namespace": "collab", "arguments": call["arguments"]},
                         {"type": "function_call_output", "call_id": call["call_id"], "output": "spawned"}],
               "tools": tools}
    prompt = server.engine.tokenizer.decode(
        server.state.renderer.render(responses_messages(history), openai_tools(history)))
    assert prompt.count('"collab__spawn_agent"') == 2    # in the tool list and in the earlier call
    nxt = httpx.post(f"{server.url}/v1/responses", json={**body, **history, "max_output_tokens": 2}, timeout=60)
    assert nxt.status_code == 200 and nxt.json()["usage"]["input_tokens"] > r["usage"]["input_tokens"]


# ---- access log, HEAD /, TTFT buckets -----------------------------------------------------------

def test_access_log_head_root_and_long_ttft_buckets(strict, caplog):
    caplog.set_level(logging.INFO, logger="moestream.serve")
    assert httpx.head(f"{strict.url}/").status_code == 200
    assert httpx.get(f"{strict.url}/").json()["model"] == "demo"
    oai, _ = clients(strict)
    oai.completions.create(model="m", prompt="The fox", max_tokens=3, extra_body={"ignore_eos": True})
    def access_lines():
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/completions 200")]

    wait_until(access_lines, timeout=10)   # the line is written once the response has gone: it may trail the client
    lines = access_lines()
    assert len(lines) == 1
    assert "generated=3" in lines[0] and "prompt=" in lines[0] and "cached=" in lines[0]
    assert "ttft=" in lines[0] and "total=" in lines[0]
    metrics = httpx.get(f"{strict.url}/metrics").text
    assert 'moestream_time_to_first_token_seconds_bucket{le="1800.0"}' in metrics
