"""The Responses API as chat completions: request translation and the answer's shapes,
without a server (tests/server/test_responses.py runs them through one)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ember.server.protocol import InvalidRequest
from ember.server.responses import ResponseBuilder, ResponsesRequest

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_text_input_and_instructions():
    r = ResponsesRequest(input="Hi there", instructions="Be brief.", max_output_tokens=7, temperature=0.0, seed=3)
    assert r.chat_request() == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        "stream": False, "max_completion_tokens": 7, "temperature": 0.0, "seed": 3}


def test_items_become_messages_and_tool_turns():
    r = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": "24 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Paris 18, Rome 24."}]},
    ], "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False})
    chat = r.chat_request()
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
        {"role": "assistant", "content": "Paris 18, Rome 24."},
    ]
    assert chat["tools"] == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                                     "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_schema", "name": "A",
                                                                           "schema": schema, "strict": True}}})
    assert r.chat_request()["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "A", "schema": schema, "strict": True, "description": None}}
    r = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_object"}}})
    assert r.chat_request()["response_format"] == {"type": "json_object"}
    assert "response_format" not in ResponsesRequest.model_validate(
        {"input": "x", "text": {"format": {"type": "text"}}}).chat_request()


def test_input_image_parts_become_chat_image_parts():
    r = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}]})
    assert r.chat_request()["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}}]}]


@pytest.mark.parametrize("body, param, message", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "ember keeps no responses"),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "items of type 'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input",
     "ember keeps no files"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]}, "input",
     "only text and input_image content parts are supported; got 'input_audio'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role must be one of"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "needs call_id as a string"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools are supported"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice", "tool_choice must be"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "include is not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "A"}}}, "text", "needs a schema"),
])
def test_refusals_name_the_field(body, param, message):
    with pytest.raises(InvalidRequest) as info:
        ResponsesRequest.model_validate(body).chat_request()
    assert info.value.param == param and message in str(info.value)


@pytest.mark.parametrize("body", [{"input": "x", "background": True}, {"input": "x", "reasoning": {"effort": "low"}},
                                  {"input": "x", "truncation": "auto"}, {"input": "x", "top_logprobs": 2},
                                  {"input": "x", "prompt": {"id": "p"}}])
def test_unhonoured_fields_are_refused(body):
    with pytest.raises(ValueError):
        ResponsesRequest.model_validate(body)


CHAT = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 4}}}


def test_response_object_from_a_chat_answer():
    out = ResponseBuilder(ResponsesRequest(input="hi", metadata={"k": "v"}), "m").from_chat(CHAT)
    assert out["id"].startswith("resp_") and out["object"] == "response" and out["status"] == "completed"
    assert [item["type"] for item in out["output"]] == ["message"]
    assert out["output"][0]["content"] == [{"type": "output_text", "text": "Hello!", "annotations": [],
                                            "logprobs": []}]
    assert out["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 2,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7}
    assert (out["store"], out["metadata"], out["incomplete_details"]) == (False, {"k": "v"}, None)
    cut = json.loads(json.dumps(CHAT))
    cut["choices"][0]["finish_reason"] = "length"
    out = ResponseBuilder(ResponsesRequest(input="hi"), "m").from_chat(cut)
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}


def _events(chunks: list[dict]) -> list[dict]:
    async def feed():
        for c in chunks:
            yield c

    async def run():
        return [e async for e in ResponseBuilder(ResponsesRequest(input="hi"), "m").events(feed())]

    out = []
    for sse in asyncio.run(run()):
        kind, data = sse.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_streamed_text_and_tool_call_events():
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "check."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                            "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                      "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": CHAT["usage"]},
    ]
    events = _events(chunks)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Let me ", "check."]
    assert events[9]["text"] == "Let me check."
    assert events[6]["item"]["arguments"] == "" and events[6]["output_index"] == 1
    assert events[12]["arguments"] == '{"city": "Oslo"}'
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_9" and final["output"][1]["arguments"] == '{"city": "Oslo"}'
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert final["usage"]["total_tokens"] == 7 and final["status"] == "completed"
