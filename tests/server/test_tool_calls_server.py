"""Tool calling through the OpenAI server (a real `ember serve` subprocess on the default
model, no tool flags, the official `openai` client): a named function and
tool_choice "required" constrain decoding to the call's JSON, so any model calls tools;
the answer's calls equal the offline computation on the same model, streamed deltas add
up to the unstreamed answer, and what instructor and langchain send works. "auto" (the
default with tools) needs no flag: the parser is read off the chat template, so the
openai client's plain tool round trip works on a default server."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field
from servers import MODEL, assert_openai_error, post

from ember import SamplingParams, StructuredOutputsParams
from ember.parsers.forced import RequiredCalls, required_schema

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def offline(llm, messages, max_tokens: int, schema: dict) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=schema))
    return llm.chat(messages, params, tools=TOOLS)[0].outputs[0].text


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls]


def reassembled(chunks) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """(calls, content, finish_reason) put back together from a stream, checking its shape:
    each call's first delta has its id, type and name, the later ones only arguments."""
    names, arguments, content, finish = {}, {}, None, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(names) and d.id.startswith("call_") and d.type == "function"
                assert d.function.name and d.function.arguments == ""
                names[d.index] = d.function.name
            else:
                assert d.index in names and d.type is None and d.function.name is None
                arguments[d.index] = arguments.get(d.index, "") + d.function.arguments
    return [(names[i], arguments.get(i, "")) for i in sorted(names)], content, finish


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 29 and call.type == "function"
    assert calls_of(choice.message) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert call.function.arguments == offline(llm, ASK, 60, WEATHER["function"]["parameters"])


def test_required_calls_one_of_the_tools_and_stops_at_one_without_parallel_calls(client, llm):
    for parallel in (True, False):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, temperature=0, max_tokens=80)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls_of(choice.message) == [("get_weather", '{"city": "Paris", "unit": "fahrenheit"}')]
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments),
                            WEATHER["function"]["parameters"])
        text = offline(llm, ASK, 80, required_schema([t["function"] for t in TOOLS], parallel))
        assert [(c.name, c.arguments) for c in RequiredCalls().extract(text).calls] == calls_of(choice.message)


@pytest.mark.parametrize("tool_choice", ["required", NAMED_TIME])
def test_streamed_tool_call_deltas_add_up_to_the_unstreamed_call(client, tool_choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls, content, finish = reassembled(chunks)
    assert (calls, content, finish) == (calls_of(whole.message), None, "tool_calls")
    assert len([c for c in chunks if c.choices and c.choices[0].delta.tool_calls]) > 3  # the arguments in pieces
    if tool_choice == NAMED_TIME:
        assert calls == [("get_time", '{"zone": "Paris"}')]


def test_a_call_cut_off_by_max_tokens_keeps_its_arguments_so_far_and_says_length(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED_TIME, temperature=0, max_tokens=3)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length"
    assert calls_of(choice.message) == [("get_time", '{"zone":')]
    assert reassembled(client.chat.completions.create(stream=True, **kw)) == (calls_of(choice.message), None, "length")


def test_tool_choice_none_answers_in_text(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                         max_tokens=20)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content == llm.chat(ASK, SamplingParams(temperature=0, max_tokens=20),
                                              tools=TOOLS)[0].outputs[0].text


ROUND_TRIP = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]


@pytest.mark.parametrize("messages", [ASK, ROUND_TRIP], ids=["ask", "tool-result"])
def test_auto_works_on_a_default_server_with_the_parser_the_template_shows(server, client, llm, messages):
    """The default model's template writes no call marker: hermes reads its answers, which
    are prose (content), as the offline chat with the same tools renders and answers."""
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), tools=TOOLS)[0].outputs[0].text
    for extra in ({}, {"tool_choice": "auto"}):
        choice = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=20, **extra).choices[0]
        assert (choice.message.content, choice.message.tool_calls) == (want, None)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                              max_tokens=20, stream=True)
    assert reassembled(streamed)[:2] == ([], want)
    log = server.log.read_text()
    assert log.count('tool_choice "auto": the hermes tool-call parser, read off the chat template') == 1


@pytest.mark.parametrize("body,words,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope', which is not among the tools", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools to choose from", "tool_choice"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools: 0.type: Input should be 'function'", "tools"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "get_weather is given more than once", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "give no other output constraint", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "only assistant messages have tool_calls",
     "messages"),
    ({"functions": [WEATHER["function"]]}, "functions is not supported: the deprecated functions field", "functions"),
])
def test_bad_tool_fields_get_400(server, body, words, param):
    error = assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, **body}),
                                400, words)
    assert error["param"] == param


def test_a_tool_result_round_trip_keeps_the_call_and_the_result_in_the_prompt(server, client, llm):
    """The default template writes neither tools nor calls, but the tool result: the rendered
    prompt is the offline renderer's, and the conversation goes on."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    tokens = post(server, "/tokenize", {"messages": history, "tools": TOOLS}).json()["tokens"]
    want = llm.inputs.chat_prompt(history, tools=TOOLS)
    assert tokens == want["prompt_token_ids"]
    assert want["prompt"].endswith('<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n{"temperature": 21}<|im_end|>\n'
                                   "<|im_start|>assistant\n")
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=12)
    assert out.usage.prompt_tokens == len(tokens)
    assert out.choices[0].message.content == llm.chat(history, SamplingParams(temperature=0, max_tokens=12),
                                                      tools=TOOLS)[0].outputs[0].text


def test_an_agent_loop_sends_the_answer_back_as_it_came(client):
    """The openai client's own message object (tool_calls, null content and the rest of
    ember's answer) goes back into the history, with the tool's result after it."""
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=60).choices[0].message
    history = ASK + [first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "21 degrees"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=5)
    assert out.choices[0].message.content and out.choices[0].message.tool_calls is None


# -- what client libraries send ----------------------------------------------------------------


class UserDetail(BaseModel):
    """A person named in the text."""

    name: str
    age: int = Field(ge=0, le=150)


EXTRACT = [{"role": "user", "content": "Extract: Jason is 25 years old."}]


def test_what_instructor_sends_in_tools_mode(client):
    """instructor's default Mode.TOOLS: one function from the model's JSON schema (its title as the
    name, the docstring as the description, `required` sorted) and tool_choice naming it; it
    reads tool_calls[0].function.arguments with model_validate_json."""
    schema = UserDetail.model_json_schema()
    parameters = {k: v for k, v in schema.items() if k not in ("title", "description")}
    parameters["required"] = sorted(k for k, v in parameters["properties"].items() if "default" not in v)
    function = {"name": schema["title"], "description": schema["description"], "parameters": parameters}
    out = client.chat.completions.create(model=MODEL, messages=EXTRACT, temperature=0, max_tokens=40,
                                         tools=[{"type": "function", "function": function}],
                                         tool_choice={"type": "function", "function": {"name": function["name"]}})
    message = out.choices[0].message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "UserDetail"
    assert UserDetail.model_validate_json(message.tool_calls[0].function.arguments) == UserDetail(name="Jason", age=25)


def test_what_langchain_with_structured_output_function_calling_sends(client):
    """langchain-openai's with_structured_output(method="function_calling"): the tool from
    convert_to_openai_tool (titles dropped from the properties), tool_choice naming it, and
    parallel_tool_calls false; it json.loads the arguments and validates them with the model."""
    schema = UserDetail.model_json_schema()
    properties = {k: {key: value for key, value in v.items() if key != "title"} for k, v in schema["properties"].items()}
    tool = {"type": "function", "function": {
        "name": "UserDetail", "description": "A person named in the text.",
        "parameters": {"properties": properties, "required": schema["required"], "type": "object"}}}
    out = client.chat.completions.create(model=MODEL, messages=EXTRACT, tools=[tool], parallel_tool_calls=False,
                                         tool_choice={"type": "function", "function": {"name": "UserDetail"}},
                                         temperature=0, max_tokens=40)
    [call] = out.choices[0].message.tool_calls
    assert UserDetail.model_validate(json.loads(call.function.arguments)) == UserDetail(name="Jason", age=25)


def test_what_pydantic_ai_sends_for_its_default_structured_output(client):
    """pydantic-ai's default output mode: a `final_result` tool whose parameters are the
    output type's schema, with tool_choice "required" (no text answer allowed); it validates
    the call's arguments with the output type."""
    tool = {"type": "function", "function": {
        "name": "final_result", "description": "The final response which ends this conversation",
        "parameters": {"additionalProperties": False, **UserDetail.model_json_schema()}}}
    out = client.chat.completions.create(model=MODEL, messages=EXTRACT, tools=[tool], tool_choice="required",
                                         temperature=0, max_tokens=40)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "final_result" and out.choices[0].finish_reason == "tool_calls"
    assert UserDetail.model_validate_json(call.function.arguments) == UserDetail(name="Jason", age=25)


class Address(BaseModel):
    street: str
    city: str


class Order(BaseModel):
    item: str
    to: Address


def test_required_calls_a_tool_whose_parameters_use_defs(client, llm):
    """A nested model's schema refers to its $defs: in the array of calls they move to the
    root, and the arguments still follow the tool's own schema."""
    ship = {"type": "function", "function": {"name": "ship", "parameters": Order.model_json_schema()}}
    messages = [{"role": "user", "content": "Ship a lamp to 5 Rue de Rivoli, Paris."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[ship, TIME], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_tokens=60)
    [call] = out.choices[0].message.tool_calls
    text = llm.chat(messages, SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=required_schema([ship["function"], TIME["function"]], False))), tools=[ship, TIME])[0].outputs[0].text
    assert [(c.name, c.arguments) for c in RequiredCalls().extract(text).calls] == [(call.function.name,
                                                                                    call.function.arguments)]
    assert (call.function.name, call.function.arguments) == (
        "ship", '{"item": "Ship", "to": {"street": "Ship", "city": "Paris"}}')  # the tiny model's best
    Order.model_validate_json(call.function.arguments)
