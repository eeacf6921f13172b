"""Tool-call parsing: recorded model outputs, malformed fallbacks, streaming == whole-text parse."""

import json
import random

import pytest

from moestream.serve.tool_calls import (
    PARSERS,
    TextDelta,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    parser_for_template,
)

HERMES, CODER = PARSERS["hermes"], PARSERS["qwen3_coder"]


def case_ids(cases):
    return [f"{case[0].name}-{i}" for i, case in enumerate(cases)]

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "threshold": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "options": {"type": "object"},
                    "hours": {"type": "array"},
                    "zip": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"properties": {}}}},
]

# (parser, text, expected plain text, expected [(name, arguments)])
RECORDED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    (HERMES, 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n',
     "Let me check.\n\n\n", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Köln\\", \\"days\\": 2}"}'
             '\n</tool_call>',
     "", [("get_weather", {"city": "Köln", "days": 2})]),
    (HERMES, '<tool_call>\n{"name": "translate", "arguments": {"text": "日本語 ✓ «ça»"}}\n</tool_call>',
     "", [("translate", {"text": "日本語 ✓ «ça»"})]),
    (HERMES, 'Before <tool_call>\n{"name": "get_time"}\n</tool_call> and after.',
     "Before  and after.", [("get_time", {})]),
    (HERMES, 'No tools here, just a < and a <tool mention.\n', "No tools here, just a < and a <tool mention.\n", []),
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "Paris", "days": 3})]),
    (CODER, "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
            "<parameter=threshold>\n2.5\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
            "<parameter=options>\n{\"unit\": \"C\", \"wind\": true}\n</parameter>\n<parameter=hours>\n[6, 12]\n"
            "</parameter>\n<parameter=zip>\n01310\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_time>\n<parameter=tz>\nBRT\n</parameter>\n</function>\n</tool_call>",
     "I'll look it up.\n\n",  # the newline between two calls is text, not trailing
     [("get_weather", {"city": "São Paulo", "threshold": 2.5, "metric": False,
                       "options": {"unit": "C", "wind": True}, "hours": [6, 12], "zip": "01310"}),
      ("get_time", {"tz": "BRT"})]),
    (CODER, "<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n\n</parameter>\n"
            "<parameter=filters>\n{\"year\": 2024}\n</parameter>\n<parameter=n>\n5\n</parameter>\n</function>\n"
            "</tool_call>\n\n",
     "", [("search", {"query": "line one\nline two\n", "filters": {"year": 2024}, "n": "5"})]),
]

MALFORMED = [
    (HERMES, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> done'),
    (HERMES, '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{not json"}\n</tool_call>'),
    (HERMES, 'Calling now <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
    (HERMES, "Almost a call <tool_call"),
    (HERMES, "Almost a call <tool_"),
    (HERMES, "Just mentioning <tool and <tool_cal here."),
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"),
    (CODER, "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
]

ALL_TEXTS = [(p, t) for p, t, _, _ in RECORDED] + MALFORMED


def run_stream(parser, deltas, tools=None):
    stream = parser.stream(tools)
    events = []
    for d in deltas:
        events += stream.push(d)
    return events + stream.finish()


def collect(events):
    """Events → (plain text, calls), checking the event contract along the way."""
    text, calls, started, args = "", [], {}, {}
    for ev in events:
        if isinstance(ev, TextDelta):
            assert ev.text
            text += ev.text
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls) and ev.index not in started
            started[ev.index] = ev
            args[ev.index] = ""
        elif isinstance(ev, ToolArgumentsDelta):
            assert ev.index in started
            args[ev.index] += ev.json
        else:
            assert isinstance(ev, ToolCallEnd)
            start = started[ev.index]
            assert (start.id, start.name) == (ev.call.id, ev.call.name)
            assert args[ev.index] == ev.call.arguments_json()
            calls.append(ev.call)
    assert len(calls) == len(started)
    return text, calls


def random_splits(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("parser,text,plain,expected", RECORDED, ids=case_ids(RECORDED))
def test_parse_recorded(parser, text, plain, expected):
    got_plain, calls = parser.parse(text, WEATHER_TOOLS)
    assert got_plain == plain
    assert [(c.name, c.arguments) for c in calls] == expected
    for c in calls:
        assert json.loads(c.arguments_json()) == c.arguments


def test_arguments_json_keeps_unicode():
    call = ToolCall("translate", {"text": "日本語"})
    assert call.arguments_json() == '{"text": "日本語"}'


def test_schema_string_keeps_number_like_text_and_failed_conversion_keeps_text():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=zip>\n007\n</parameter>\n"
            "<parameter=days>\nthree\n</parameter>\n<parameter=metric>\nyes\n</parameter>\n"
            "<parameter=options>\n{broken\n</parameter>\n</function>\n</tool_call>")
    _, [call] = CODER.parse(text, WEATHER_TOOLS)
    assert call.arguments == {"zip": "007", "days": "three", "metric": "yes", "options": "{broken"}


def test_without_schema_values_stay_text_except_json_objects_and_arrays():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=options>\n{\"a\": 1}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
            "</function>\n</tool_call>")
    _, [call] = CODER.parse(text, None)
    assert call.arguments == {"days": "3", "options": {"a": 1}, "hours": [1, 2]}


@pytest.mark.parametrize("parser,text", MALFORMED, ids=case_ids(MALFORMED))
def test_malformed_is_plain_text(parser, text):
    plain, calls = parser.parse(text, WEATHER_TOOLS)
    assert (plain, calls) == (text, [])
    assert collect(run_stream(parser, [text], WEATHER_TOOLS)) == (text, [])


def test_malformed_block_between_good_calls_keeps_its_text():
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    bad = '<tool_call>\n{"name": oops}\n</tool_call>'
    plain, calls = HERMES.parse(good + "\n" + bad + "\n" + good + "\n")
    assert plain == "\n" + bad + "\n"
    assert [c.name for c in calls] == ["get_time", "get_time"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("parser,text", ALL_TEXTS, ids=case_ids(ALL_TEXTS))
def test_stream_equals_parse_for_random_splits(parser, text, seed):
    rng = random.Random(seed)
    plain, calls = parser.parse(text, WEATHER_TOOLS)
    expected = (plain, [(c.name, c.arguments) for c in calls])
    for _ in range(25):
        got_plain, got_calls = collect(run_stream(parser, random_splits(text, rng), WEATHER_TOOLS))
        assert (got_plain, [(c.name, c.arguments) for c in got_calls]) == expected


@pytest.mark.parametrize("parser,text", ALL_TEXTS, ids=case_ids(ALL_TEXTS))
def test_stream_one_character_at_a_time(parser, text):
    plain, calls = parser.parse(text, WEATHER_TOOLS)
    got_plain, got_calls = collect(run_stream(parser, list(text), WEATHER_TOOLS))
    assert got_plain == plain
    assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls]


def test_text_is_released_before_the_call_closes():
    stream = HERMES.stream()
    assert stream.push("Hello ") == [TextDelta("Hello ")]
    assert stream.push("Hi <tool_") == [TextDelta("Hi ")]
    assert stream.push('call>\n{"name": "get_time", "arguments": {}}\n') == []
    events = stream.push("</tool_call>")
    assert [type(e) for e in events] == [ToolCallStart, ToolArgumentsDelta, ToolCallEnd]
    assert events[0].name == "get_time" and events[1].json == "{}" and events[2].call.id == events[0].id
    assert stream.finish() == []


def test_held_prefix_that_is_not_a_tag_is_released():
    stream = HERMES.stream()
    assert stream.push("a <tool") == [TextDelta("a ")]
    assert stream.push("box>") == [TextDelta("<toolbox>")]
    assert stream.push("<") == []
    assert stream.finish() == [TextDelta("<")]


def test_trailing_whitespace_after_last_call_is_dropped_but_kept_before_text():
    block = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    stream = HERMES.stream()
    assert [type(e) for e in stream.push(block)] == [ToolCallStart, ToolArgumentsDelta, ToolCallEnd]
    assert stream.push("\n\n") == []
    assert stream.push("ok") == [TextDelta("\n\nok")]
    assert HERMES.parse(block + "\n\n")[0] == ""
    assert HERMES.parse(block + "\n\nok")[0] == "\n\nok"


@pytest.mark.parametrize("template,expected", [
    (None, "hermes"),
    ("", "hermes"),
    ("{% for tool in tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endfor %}", "hermes"),
    ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue\n"
     "</parameter>\n</function>\n</tool_call>", "qwen3_coder"),
    ("mentions <function= only", "hermes"),
])
def test_parser_for_template(template, expected):
    parser = parser_for_template(template)
    assert parser is PARSERS[expected] and parser.name == expected


def test_ids_are_unique_and_openai_shaped():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' * 50
    _, calls = HERMES.parse(text)
    ids = [c.id for c in calls] + [c.id for c in CODER.parse(RECORDED[6][1])[1]]
    assert len(ids) == 51 and len(set(ids)) == 51
    for i in ids:
        assert i.startswith("call_") and len(i) == 29 and i[5:].isalnum()


def test_odd_schemas_and_values_never_raise():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": [1, 2]}}},
             {"type": "function", "function": {"name": "g", "parameters": {"properties": {
                 "a": {"type": {"weird": 1}}, "n": {"type": "number"}, "m": {"type": ["integer", "null"]}}}}},
             "not a tool"]
    text = ("<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
            "<tool_call>\n<function=g>\n<parameter=a>\n[1]\n</parameter>\n<parameter=n>\nnan\n</parameter>\n"
            "<parameter=m>\n7\n</parameter>\n</function>\n</tool_call>")
    _, calls = CODER.parse(text, tools)
    assert [c.arguments for c in calls] == [{"x": "1"}, {"a": [1], "n": "nan", "m": 7}]


FRAGMENTS = ["Hi ", " ", "\n", "<", "<tool", "<tool_call>", "</tool_call>", "</tool", "{", "}",
             '{"name": "f", "arguments": {"k": "v"}}', '"name"', "<function=f>", "</function>",
             "<parameter=k>", "\nv\n", "</parameter>", "x",
             '<tool_call>\n{"name": "f", "arguments": {"k": "v"}}\n</tool_call>',
             "<tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>"]


@pytest.mark.parametrize("parser", [HERMES, CODER], ids=lambda p: p.name)
def test_stream_equals_parse_on_random_fragment_soup(parser):
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 20)))
        plain, calls = parser.parse(text)
        got_plain, got_calls = collect(run_stream(parser, random_splits(text, rng)))
        assert got_plain == plain, text
        assert [(c.name, c.arguments) for c in got_calls] == [(c.name, c.arguments) for c in calls], text
