"""POST /v1/responses through a real `ember serve` on the default model with the official
`openai` client (`client.responses`): each answer equals the chat completion the request
translates to, on the same server (greedy), streamed events add up to the unstreamed
answer, and a named function tool gives a function_call item."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from servers import KEY, MODEL, assert_openai_error, post

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat_text(client, messages, **kw) -> tuple[str, str]:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return out.choices[0].message.content, out.choices[0].finish_reason


def test_text_input_answers_as_the_chat_completion(client):
    out = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one word.",
                                  max_output_tokens=40, temperature=0)
    text, finish = chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                      {"role": "user", "content": QUESTION}], max_tokens=40)
    assert finish == "stop" and out.status == "completed" and out.incomplete_details is None
    assert out.output_text == text and text
    [item] = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert out.id.startswith("resp_") and out.object == "response" and out.model == MODEL and out.store is False
    assert out.usage.output_tokens > 0 and out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    out = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Tell me a long story."}],
                                  max_output_tokens=5, temperature=0)
    text, finish = chat_text(client, [{"role": "user", "content": "Tell me a long story."}], max_tokens=5)
    assert finish == "length" and out.output_text == text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 5


def test_stream_adds_up_to_the_answer(client):
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text and events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**kw) as stream:  # the SDK's own accumulation of the events
        assert stream.get_final_response().output_text == whole.output_text


def test_function_tools_with_auto_need_no_server_flag(client):
    """The default model answers in prose: a message item, as with tool_choice "none"."""
    kw = dict(model=MODEL, input=QUESTION, tools=[WEATHER], max_output_tokens=12, temperature=0)
    auto, none = client.responses.create(**kw), client.responses.create(tool_choice="none", **kw)
    assert [item.type for item in auto.output] == ["message"] and auto.output_text == none.output_text != ""


def test_a_named_function_tool_gives_a_function_call(client):
    kw = dict(model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0)
    out = client.responses.create(**kw)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": kw["input"]}], temperature=0, max_tokens=40,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert out.output_text == ""
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == call.arguments and [e.arguments for e in done] == [call.arguments]
    assert events[-1].response.output[0].name == "get_weather"


def test_a_tool_result_round_trip_renders_as_the_chat_history(client, server):
    """Input items with the model's call and its result: the prompt is the chat one with the
    assistant's tool_calls and the tool message (its tokens counted in usage)."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]
    out = client.responses.create(model=MODEL, input=items, tools=[WEATHER], tool_choice="none",
                                  max_output_tokens=12, temperature=0)
    messages = [items[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    tokens = post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": [
        {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]}).json()
    assert out.usage.input_tokens == tokens["count"]
    text, _ = chat_text(client, messages, max_tokens=12)
    assert out.output_text == text


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    out = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text.format.type == "json_schema"


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "previous_response_id": "resp_123"}, "previous_response_id", ["ember keeps no responses"]),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", ["only function tools are supported"]),
    ({"input": "x", "background": True}, None, ["background"]),
])
def test_refusals(server, body, param, words):
    error = assert_openai_error(post(server, "/v1/responses", {"model": MODEL, **body}), 400, *words)
    assert error["type"] == "invalid_request_error" and (param is None or error["param"] == param)


@pytest.mark.parametrize("method,path", [("GET", "/v1/responses/resp_123"), ("DELETE", "/v1/responses/resp_123"),
                                         ("POST", "/v1/responses/resp_123/cancel")])
def test_a_stored_response_is_not_found_and_says_why(server, method, path):
    r = httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    error = assert_openai_error(r, 404, "ember keeps no responses", "'resp_123'")
    assert (error["param"], error["code"]) == ("response_id", "response_not_found")
