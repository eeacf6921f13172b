"""The server driven by the official `openai` and `anthropic` clients, on loopback, with the demo model.

Greedy decoding on fp32 CPU makes every answer reproducible, so streaming and non-streaming,
batched and alone, cached and cold can be compared token for token."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import MAX_CONTEXT

PROMPT = [{"role": "user", "content": "Once upon a time there was a little fox who"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server):
    import anthropic   # here, not at collection: its import takes ~3 s, in every worker that collects

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


# ---- Chat Completions ------------------------------------------------------------------------

def test_chat_streaming_equals_non_streaming_and_counts_usage(oai, force):
    # The demo model is not chat-tuned (it ends a ChatML turn at once), so the reply is forced.
    force("FOXCHAT", "The fox jumped over the lazy dog and ran into the woods.")
    messages = [{"role": "user", "content": "FOXCHAT tell me a story"}]
    whole = oai.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=12, temperature=0)
    assert whole.model == "demo" and whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and whole.usage.prompt_tokens > 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 12
    assert choice.message.content.startswith("The fox jumped")
    chunks = list(oai.chat.completions.create(model="any-name", messages=messages, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0          # the same prompt again: reused


def test_stop_strings_end_the_text_before_them(oai):
    free = oai.completions.create(model="m", prompt="The little fox", max_tokens=16, temperature=0).choices[0].text
    assert len(free) > 6
    stop = free[3:6]
    cut = oai.completions.create(model="m", prompt="The little fox", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[:free.index(stop)]
    chat = oai.chat.completions.create(model="m", messages=PROMPT, max_tokens=16, temperature=0)
    assert "<|im_end|>" not in chat.choices[0].message.content     # the end of a turn ends the reply


def test_unsupported_fields_are_answered_clearly(oai):
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        oai.chat.completions.create(model="m", messages=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        oai.chat.completions.create(model="m", messages=PROMPT, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(model="m", messages=PROMPT, response_format={"type": "json_object"})
    # Fields agents send that a local server accepts and ignores.
    ok = oai.chat.completions.create(model="m", messages=PROMPT, max_tokens=2, temperature=0, user="me",
                                     parallel_tool_calls=True, store=False, prompt_cache_key="k",
                                     extra_body={"reasoning": {"effort": "low"}})
    assert ok.choices[0].message.content is not None


def test_a_forced_tool_call_comes_back_structured_and_streams_as_deltas(oai, force):
    force("TOOLTEST", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
    messages = [{"role": "user", "content": "TOOLTEST: weather in Paris?"}]
    r = oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER], temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks = list(oai.chat.completions.create(model="m", messages=messages, tools=[WEATHER], temperature=0,
                                              max_tokens=60, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The next turn carries the call and its result; the template renders both.
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = oai.chat.completions.create(model="m", messages=follow, tools=[WEATHER], temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_malformed_tool_text_falls_back_to_plain_text(oai, force):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    force("BROKENTOOL", broken)
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "BROKENTOOL"}], tools=[WEATHER],
                                    temperature=0, max_tokens=60)
    assert r.choices[0].message.content == broken and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


# ---- Completions -----------------------------------------------------------------------------

def test_completions_text_and_token_ids(oai, demo_engine):
    r = oai.completions.create(model="m", prompt="The fox", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 8
    ids = demo_engine.encode("The fox")
    by_ids = oai.completions.create(model="m", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="m", prompt="The fox", max_tokens=8,
                                                                        temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    assert demo_engine.generate("The fox", max_tokens=8) == r.choices[0].text   # the engine's own answer


def test_completions_return_the_generated_token_ids_on_request(server, demo_engine):
    body = {"model": "m", "prompt": [5, 6, 7] + list(range(100, 130)), "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert "token_ids" not in plain["choices"][0]
    whole = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}).json()["choices"][0]
    assert len(whole["token_ids"]) == 6 and demo_engine.tokenizer.decode(whole["token_ids"]) == whole["text"]
    ids = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "return_token_ids": True, "stream": True}) as r:
        for line in r.iter_lines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                ids += choice.get("token_ids") or []
    assert ids == whole["token_ids"]
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": "yes"})
    assert bad.status_code == 400 and "return_token_ids" in bad.json()["error"]["message"]


def test_a_second_turn_reuses_the_first_and_equals_a_cold_run(oai, demo_engine):
    first = [5, 6, 7] + list(range(100, 160))
    one = oai.completions.create(model="m", prompt=first, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    reply = demo_engine.tokenizer(one.choices[0].text, add_special_tokens=False).input_ids
    second = first + reply[:-1] + [42, 43, 44]
    warm = oai.completions.create(model="m", prompt=second, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    block = demo_engine.blocks.block_size   # a paged cache shares whole blocks
    assert warm.usage.prompt_tokens_details.cached_tokens >= len(first) // block * block
    demo_engine.clear_prefix_cache()
    cold = oai.completions.create(model="m", prompt=second, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].text == cold.choices[0].text


# ---- Responses -------------------------------------------------------------------------------

def test_responses_create_and_stream_agree(oai):
    r = oai.responses.create(model="codex", input="Once upon a time", max_output_tokens=10, temperature=0, store=False)
    assert r.status in ("completed", "incomplete") and r.object == "response"
    assert r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    with oai.responses.stream(model="codex", input="Once upon a time", max_output_tokens=10, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text


def test_responses_function_call_and_its_output_on_the_next_turn(oai, force):
    force("RESPTOOL", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    with oai.responses.stream(model="codex", input="RESPTOOL", tools=[tool], temperature=0,
                              max_output_tokens=60) as stream:
        final = stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    nxt = oai.responses.create(model="codex", tools=[tool], temperature=0, max_output_tokens=4, instructions="Be brief.",
                               input=[{"role": "user", "content": "RESPTOOL"},
                                      {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                                       "arguments": calls[0].arguments},
                                      {"type": "function_call_output", "call_id": calls[0].call_id, "output": "rain"}])
    assert nxt.usage.input_tokens > final.usage.input_tokens


def test_responses_state_is_refused_clearly(oai):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.create(model="m", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="store"):
        oai.responses.create(model="m", input="hi", store=True)


# ---- Anthropic Messages ----------------------------------------------------------------------

def test_messages_create_and_stream(claude, force):
    force("FOXCLAUDE", "The fox jumped over the lazy dog and ran into the woods.")
    messages = [{"role": "user", "content": "FOXCLAUDE tell me a story"}]
    m = claude.messages.create(model="claude-local", max_tokens=10, messages=messages,
                               system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                               metadata={"user_id": "u"})
    assert m.type == "message" and m.role == "assistant" and m.model == "demo"
    assert m.usage.output_tokens == 10
    assert m.stop_reason == "max_tokens" and m.content[0].text.startswith("The fox")
    with claude.messages.stream(model="claude", max_tokens=10, messages=messages,
                                system="Be brief.") as stream:
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text
    assert final.usage.cache_read_input_tokens > 0 and final.usage.output_tokens == m.usage.output_tokens
    count = claude.messages.count_tokens(model="claude", messages=messages, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_tool_use_round_trip_and_stop_sequences(claude, force):
    force("CLAUDETOOL", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"],
              "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "CLAUDETOOL"}]}]
    with claude.messages.stream(model="claude", max_tokens=60, messages=msgs, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = [b for b in final.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.input == {"city": "Rome"}
    follow = msgs + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                       {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hot"}]}]
    nxt = claude.messages.create(model="claude", max_tokens=3, messages=follow, tools=tools,
                                 extra_headers={"anthropic-beta": "whatever-2025"})
    assert nxt.usage.output_tokens >= 1
    force("STOPSEQ", "alpha beta gamma")
    s = claude.messages.create(model="claude", max_tokens=30, messages=[{"role": "user", "content": "STOPSEQ"}],
                               stop_sequences=["gamma"], extra_body={"temperature": 0})
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == "gamma" and s.content[0].text == "alpha beta "


def test_anthropic_errors_have_the_anthropic_shape(claude, server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="claude", max_tokens=5, messages=[{"role": "wizard", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in err.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": "c", "messages": PROMPT})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


# ---- errors, limits, information ---------------------------------------------------------------

def test_bad_requests_get_the_right_status_and_body(server, oai):
    url = server.url
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (33 * 2**20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{url}/v1/models/not-this-one")
    assert r.status_code == 404 and "demo" in r.json()["error"]["message"]
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="context holds"):
        oai.completions.create(model="m", prompt=list(range(1, MAX_CONTEXT + 5)), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model="m", messages=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="role"):
        oai.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert [m.id for m in oai.models.list()] == ["demo"] and oai.models.retrieve("demo").id == "demo"


def test_metrics_count_the_kernel_variants_compiled_in_the_process(monkeypatch):
    """A count read at each scrape, so a served step that compiled (a stall) shows as a count that grew."""
    import moestream.serve.metrics as metrics

    class Engine:
        def prefix_cache_stats(self):
            return None

        def stats(self):
            return {"hit_rate": 1.0, "bytes_copied": 0}

    compiled = {"moestream.kernels.a._kernel": 2, "moestream.kernels.b._kernel": 3}
    monkeypatch.setattr(metrics, "compiled_variants", lambda: dict(compiled))
    served = metrics.ServerMetrics(Engine())
    assert "moestream_kernel_variants_compiled 5.0" in served.render().decode()
    compiled["moestream.kernels.b._kernel"] = 4
    assert "moestream_kernel_variants_compiled 6.0" in served.render().decode()


def test_health_metrics_and_cache_stats(server, oai):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    oai.chat.completions.create(model="m", messages=PROMPT, max_tokens=2, temperature=0)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'moestream_requests_total{api="chat",status="200"}' in metrics
    for name in ("moestream_time_to_first_token_seconds_count", "moestream_prompt_cached_tokens_total",
                 "moestream_queue_depth", "moestream_bank_hit_rate", "moestream_prefix_cache_hit_rate",
                 "moestream_kv_cache_rows", "moestream_inter_token_seconds_bucket", "moestream_kernel_variants_compiled"):
        assert name in metrics
    steps = {kind: float(line.split()[1]) for line in metrics.splitlines() for kind in ("prompt", "decode")
             if line.startswith(f'moestream_step_seconds_count{{kind="{kind}"}}')}
    assert steps["prompt"] >= 1 and steps["decode"] >= 1   # the prompt's step, then the second token's
    stats = httpx.get(f"{server.url}/v1/cache/stats").json()
    assert stats["prefix_cache"]["entries"] >= 1 and "hit_rate" in stats["bank"]
    prefix = stats["prefix_cache"]
    assert prefix["blocks"] > 0 and prefix["blocks_used"] == 0 and prefix["blocks_cached"] >= 1
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("moestream_kv_cache_blocks")}
    assert values["moestream_kv_cache_blocks"] == prefix["blocks"] and values["moestream_kv_cache_blocks_used"] == 0


def test_responses_custom_tools_round_trip_as_raw_text(oai, force):
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch"
    force("CUSTOMTOOL", '<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": patch}}) + '\n</tool_call>')
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}
    r = oai.responses.create(model="codex", input="CUSTOMTOOL", tools=[tool], temperature=0, max_output_tokens=80)
    calls = [item for item in r.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch" and calls[0].input == patch
    with oai.responses.stream(model="codex", input="CUSTOMTOOL", tools=[tool], temperature=0,
                              max_output_tokens=80) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(done) == 1 and done[0].input == patch
    nxt = oai.responses.create(model="codex", tools=[tool], temperature=0, max_output_tokens=2,
                               input=[{"role": "user", "content": "CUSTOMTOOL"},
                                      {"type": "custom_tool_call", "call_id": calls[0].call_id, "name": "apply_patch",
                                       "input": patch},
                                      {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "Done!"}])
    assert nxt.usage.input_tokens > r.usage.input_tokens
