"""Anthropic's Messages API (server/messages.py) through the `anthropic` client library on
the default server: plain, with a system prompt, streamed, stop sequences, a forced tool
call and a tool-result round trip, count_tokens, and errors in Anthropic's shape; each
answer equal to the offline chat it translates to."""

from __future__ import annotations

import json

import pytest
from servers import KEY, MODEL

from ember import SamplingParams, StructuredOutputsParams
from ember.parsers.forced import parameters_schema

anthropic = pytest.importorskip("anthropic")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
# the SDK of today has no sampling fields (the API still takes them, as older clients send them)
GREEDY = {"extra_body": {"temperature": 0}}
CHAT_TOOLS = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                "parameters": WEATHER["input_schema"]}}]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def offline(llm, messages, max_tokens: int = 16, tools=None, **params):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens, **params), tools=tools)[0]


def test_a_message_answers_as_the_offline_chat(claude, llm):
    want = offline(llm, ASK)
    out = claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, **GREEDY)
    assert [(b.type, b.text) for b in out.content] == [("text", want.outputs[0].text)]
    assert out.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.outputs[0].finish_reason]
    assert (out.role, out.model, out.id[:4]) == ("assistant", MODEL, "msg_")
    assert out.usage.output_tokens == len(want.outputs[0].token_ids)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(want.prompt_token_ids)


def test_the_system_prompt_and_a_stream(claude, llm):
    system = "You answer in French."
    want = offline(llm, [{"role": "system", "content": system}] + ASK, max_tokens=12).outputs[0].text
    kw = dict(model=MODEL, max_tokens=12, system=system, messages=ASK, **GREEDY)
    assert claude.messages.create(**kw).content[0].text == want
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want == final.content[0].text and final.usage.output_tokens > 0
    events = [e.type for e in claude.messages.create(stream=True, **kw)]
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == \
        ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_is_named_as_the_stop(claude, llm):
    text = offline(llm, ASK).outputs[0].text
    word = text.split()[1]  # a word the answer reaches
    out = claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, stop_sequences=[word], **GREEDY)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", word)
    assert out.content[0].text == text[:text.index(word)]


def test_a_forced_tool_call_and_its_result_round_trip(claude, llm):
    schema = parameters_schema(CHAT_TOOLS[0]["function"])
    args = offline(llm, ASK, 40, CHAT_TOOLS, structured_outputs=StructuredOutputsParams(json=schema)).outputs[0].text
    kw = dict(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER], **GREEDY,
              tool_choice={"type": "tool", "name": "get_weather"})
    out = claude.messages.create(**kw)
    (call,) = out.content
    assert (call.type, call.name, call.input, out.stop_reason) == ("tool_use", "get_weather", json.loads(args),
                                                                    "tool_use")
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert (streamed.content[0].name, streamed.content[0].input) == ("get_weather", call.input)

    history = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                                        "input": call.input}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 C and sunny"}]}]
    chat_history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    want = offline(llm, chat_history, 16, CHAT_TOOLS).outputs[0].text
    answer = claude.messages.create(model=MODEL, max_tokens=16, messages=history, tools=[WEATHER], **GREEDY)
    assert [(b.type, b.text) for b in answer.content] == [("text", want)]


def test_count_tokens_counts_the_rendered_prompt(claude, llm):
    tools_prompt = offline(llm, ASK, 1, CHAT_TOOLS).prompt_token_ids
    assert claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens == \
        len(offline(llm, ASK, 1).prompt_token_ids)
    assert claude.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens == len(tools_prompt)


def test_errors_come_in_anthropics_shape(claude, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, thinking={"type": "enabled",
                                                                                  "budget_tokens": 1024})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking of type enabled is not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}])
    assert "only text blocks" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-opus-4", max_tokens=8, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


def test_output_config_format_is_structured_output_and_fields_without_effect_change_nothing(claude, llm, server):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    want = offline(llm, ASK, 40, structured_outputs=StructuredOutputsParams(json=schema)).outputs[0].text
    out = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, **GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}},
                                 cache_control={"type": "ephemeral"}, metadata={"user_id": "u1"}, speed="standard",
                                 service_tier="auto", thinking={"type": "disabled"})
    assert out.content[0].text == want and set(json.loads(want)) == {"capital"}
    log = server.log.read_text()
    assert all(log.count(f"request field {name}: accepted, no effect") == 1 for name in ("cache_control", "speed"))
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, output_config={"effort": "low"})
    assert "no reasoning_effort variable" in e.value.body["error"]["message"]
