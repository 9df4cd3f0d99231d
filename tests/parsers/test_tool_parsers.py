"""The tool-call parsers on canned model text of each format (as Qwen2.5, Llama 3.1,
Mistral and Llama 3.2 write it): the whole text's parse, and the same text streamed in
small pieces, whose deltas add up to exactly that parse."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ember.parsers import TOOL_PARSERS, ExtractedToolCalls, FunctionCall, ToolCallStream, get_tool_parser
from ember.parsers.forced import NamedCall, RequiredCalls, required_schema

WEATHER = '{"city": "Paris", "unit": "celsius"}'
CASES = {
    "hermes": [
        # Qwen2.5: prose, then one call per <tool_call> block
        ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
         '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
         ExtractedToolCalls("I will check both.\n", (FunctionCall("get_weather", WEATHER),
                                                       FunctionCall("get_time", '{"zone": "Europe/Paris"}')))),
        ('<tool_call>\n{"name": "search", "arguments": {"q": "a \\"quoted\\" <tag> \\u00e9t\\u00e9", "n": 12, '
         '"x": -1.5e3, "ok": true, "none": null, "list": [1, [2, {"k": "v"}]]}}\n</tool_call>',
         ExtractedToolCalls(None, (FunctionCall("search", '{"q": "a \\"quoted\\" <tag> été", "n": 12, "x": -1500.0, '
                                                          '"ok": true, "none": null, "list": [1, [2, {"k": "v"}]]}'),))),
        ("The capital of France is Paris.", ExtractedToolCalls("The capital of France is Paris.")),
        ("Use a <b>tag</b> < 3", ExtractedToolCalls("Use a <b>tag</b> < 3")),
        # a block that is not JSON: the whole text is content
        ("<tool_call>\nget_weather(Paris)\n</tool_call>", ExtractedToolCalls("<tool_call>\nget_weather(Paris)\n</tool_call>")),
        # the end tag left out before EOS (Qwen does this at times)
        ('<tool_call>\n{"name": "get_time", "arguments": {}}', ExtractedToolCalls(None, (FunctionCall("get_time", "{}"),))),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
         ExtractedToolCalls(None, (FunctionCall("get_weather", WEATHER),))),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}',
         ExtractedToolCalls(None, (FunctionCall("get_weather", WEATHER), FunctionCall("get_time", '{"zone": "CET"}')))),
        ("Paris is the capital of France.", ExtractedToolCalls("Paris is the capital of France.")),
        ('{"answer": 42}', ExtractedToolCalls('{"answer": 42}')),  # JSON, but not a call
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]',
         ExtractedToolCalls(None, (FunctionCall("get_weather", WEATHER), FunctionCall("get_time", '{"zone": "CET"}')))),
        ('Let me look. [TOOL_CALLS][{"name": "noop", "arguments": {}}]',
         ExtractedToolCalls("Let me look. ", (FunctionCall("noop", "{}"),))),
        ("I cannot help with [that].", ExtractedToolCalls("I cannot help with [that].")),
        ("[TOOL_CALLS] not json", ExtractedToolCalls("[TOOL_CALLS] not json")),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]',
         ExtractedToolCalls(None, (FunctionCall("get_weather", WEATHER), FunctionCall("get_time", '{"zone": "CET"}')))),
        ('<tool_call>[{"name": "noop", "arguments": {}}]', ExtractedToolCalls(None, (FunctionCall("noop", "{}"),))),
        ("Paris is the capital of France.", ExtractedToolCalls("Paris is the capital of France.")),
        ("<|tool_call|> not json", ExtractedToolCalls("<|tool_call|> not json")),
    ],
    "internlm": [
        ('Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris", '
         '"unit": "celsius"}}<|action_end|>\n',
         ExtractedToolCalls("Let me check.", (FunctionCall("get_weather", WEATHER),))),
        ('<|action_start|><|plugin|>{"name": "get_time", "arguments": {"zone": "CET"}}<|action_end|>',
         ExtractedToolCalls(None, (FunctionCall("get_time", '{"zone": "CET"}'),))),
        ("Paris is the capital of France.", ExtractedToolCalls("Paris is the capital of France.")),
        ("<|action_start|><|plugin|>not json<|action_end|>",
         ExtractedToolCalls("<|action_start|><|plugin|>not json<|action_end|>")),
    ],
    "pythonic": [
        ("[get_weather(city='San Francisco', unit=\"celsius\"), get_time(zone='Europe/Paris (CET)', hours=[1, 2], "
         "dst=True, note=None)]",
         ExtractedToolCalls(None, (FunctionCall("get_weather", '{"city": "San Francisco", "unit": "celsius"}'),
                                   FunctionCall("get_time", '{"zone": "Europe/Paris (CET)", "hours": [1, 2], '
                                                            '"dst": true, "note": null}')))),
        ("[noop()]", ExtractedToolCalls(None, (FunctionCall("noop", "{}"),))),
        ("Paris.", ExtractedToolCalls("Paris.")),
        ("[1, 2, 3]", ExtractedToolCalls("[1, 2, 3]")),  # a list, but not of calls
        ("[run(cmd=__import__('os'))]", ExtractedToolCalls("[run(cmd=__import__('os'))]")),  # nothing is evaluated
    ],
}
ALL = [(name, text, want) for name, cases in CASES.items() for text, want in cases]


def streamed(parser, text: str, step: int, max_calls: int | None = None) -> ExtractedToolCalls:
    """The text fed `step` characters at a time; the deltas put back together."""
    stream = ToolCallStream(parser, max_calls)
    content, names, arguments, ids = "", {}, {}, {}
    for end in range(step, len(text) + step, step):
        delta = stream.update(text[:end], final=end >= len(text))
        content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:  # a call's first delta: its id and name, no arguments yet
                assert d.index not in names and d.name and d.arguments == "" and d.id.startswith("call_")
                names[d.index], ids[d.index] = d.name, d.id
            else:
                assert d.index in names and d.name is None and d.arguments
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
    assert sorted(names) == list(range(len(names)))
    return ExtractedToolCalls(content or None, tuple(FunctionCall(names[i], arguments.get(i, "")) for i in sorted(names)))


@pytest.mark.parametrize("name,text,want", ALL)
def test_the_whole_text_parses_to_the_calls_and_the_content(name, text, want):
    assert get_tool_parser(name)().extract(text) == want
    for call in want.calls:
        json.loads(call.arguments)


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("name,text,want", ALL)
def test_streamed_deltas_add_up_to_the_whole_parse(name, text, want, step):
    assert streamed(get_tool_parser(name)(), text, step) == want


def test_a_stream_holds_back_what_may_begin_a_marker_and_sends_calls_as_they_come():
    stream = ToolCallStream(get_tool_parser("hermes")())
    assert stream.update("Sure.<tool").content == "Sure."
    assert stream.update("Sure.<tool_call>\n{\"name\": \"get_w").tool_calls == ()  # the name is not complete
    first = stream.update("Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa")
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "get_weather", ""), (0, None, '{"city": "Pa')]
    assert first.content == ""
    assert stream.update("Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}").tool_calls[0]\
        .arguments == 'ris'  # the closing quote and brace wait until the call is complete
    end = stream.update("Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")
    assert [d.arguments for d in end.tool_calls] == ['"}']


def test_a_number_is_sent_only_once_it_cannot_grow():
    stream = ToolCallStream(get_tool_parser("mistral")())
    pieces = [stream.update('[TOOL_CALLS][{"name": "f", "arguments": {"n": 1' + tail).tool_calls
              for tail in ("", "2", "25", "25,", '25, "m": 2}}]')]
    assert [[d.arguments for d in p] for p in pieces] == [["", "{"], [], [], ['"n": 125'], [', "m": 2}']]


def test_without_parallel_calls_only_the_first_call_counts():
    text = CASES["hermes"][0][0]
    parser = get_tool_parser("hermes")()
    assert parser.extract(text, max_calls=1).calls == (FunctionCall("get_weather", WEATHER),)
    assert streamed(parser, text, 4, max_calls=1) == parser.extract(text, max_calls=1)


def test_the_registry_names_each_parser_and_refuses_an_unknown_one():
    assert sorted(TOOL_PARSERS) == ["deepseek_v31", "glm45", "granite", "hermes", "internlm", "kimi_k2", "llama3_json",
                                    "mistral", "openai", "pythonic", "qwen3_coder"]
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen': choose one of deepseek_v31, glm45, granite, hermes"):
        get_tool_parser("qwen")


# -- the calls a constraint forces (tool_choice required / a named function) ----------------

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}
FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                           "required": ["city"]}},
    {"name": "ship", "parameters": {"$defs": {"Address": ADDRESS}, "type": "object",
                                    "properties": {"to": {"$ref": "#/$defs/Address"}}, "required": ["to"]}},
    {"name": "noop"},
]


def test_the_required_schema_takes_calls_of_the_tools_and_nothing_else():
    schema = required_schema(FUNCTIONS, parallel=True)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "ship", "parameters": {"to": {"street": "Rue de Rivoli"}}}, {"name": "noop", "parameters": {}}]
    jsonschema.validate(good, schema)
    assert schema["$defs"] == {"tool1.Address": ADDRESS}  # moved to the root, where the reference now points
    for bad in ([], [{"name": "ship", "parameters": {"to": {"street": 1}}}], [{"name": "other", "parameters": {}}],
                [{"name": "get_weather", "parameters": {}}], [{"name": "noop", "parameters": {}, "x": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(FUNCTIONS, parallel=False)
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


@pytest.mark.parametrize("step", [1, 3, 7])
def test_required_and_named_outputs_stream_as_they_parse(step):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]'
    want = ExtractedToolCalls(None, (FunctionCall("get_weather", '{"city": "Paris"}'), FunctionCall("noop", "{}")))
    assert RequiredCalls().extract(text) == streamed(RequiredCalls(), text, step) == want
    named = NamedCall("get_weather")
    assert named.extract(WEATHER) == streamed(named, WEATHER, step) == ExtractedToolCalls(
        None, (FunctionCall("get_weather", WEATHER),))


def test_a_required_array_cut_off_keeps_the_calls_it_began():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {"a": "b'
    assert RequiredCalls().extract(text).calls == (FunctionCall("get_weather", '{"city": "Paris"}'),
                                                   FunctionCall("noop", '{"a": "b'))
    assert streamed(RequiredCalls(), text, 2) == RequiredCalls().extract(text)
