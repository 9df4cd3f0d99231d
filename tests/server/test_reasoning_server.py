"""--reasoning-parser on a real server: deepseek_r1 takes an output without </think> as
all reasoning (its template opens <think> in the prompt), so the default model's answer
comes back as `reasoning_content`, streamed or not. A tool call or response_format is
constrained only after </think> (the default model echoes a text with </think> in it):
reasoning_content, then the call's arguments or the JSON, equal to the offline gated run,
on the chat route and the Responses API."""

from __future__ import annotations

import json

import pytest
from servers import MODEL, serving

from ember import SamplingParams, StructuredOutputsParams
from ember.parsers.forced import parameters_schema
from ember.parsers.reasoning import get_reasoning_parser

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    yield from serving(gguf_path, tmp_path_factory, "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_the_reasoning_comes_back_as_reasoning_content_streamed_or_not(client, llm):
    ref = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    text = ref.text
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    choice = client.chat.completions.create(**kw).choices[0]
    message = choice.message
    assert (message.reasoning_content, message.content, choice.finish_reason) == (text, None, ref.finish_reason)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == text and not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_include_reasoning_false_drops_the_reasoning(client, llm):
    ref = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16, extra_body={"include_reasoning": False})
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == \
        (None, None, ref.finish_reason)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks)
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_a_thinking_budget_ends_the_reasoning_after_that_many_tokens(client, llm):
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    free = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    budget = SamplingParams(temperature=0, max_tokens=16, thinking_token_budget=3, thinking_end_token_ids=end)
    ref = llm.chat(ASK, budget)[0].outputs[0]
    assert ref.token_ids[:3] == free.token_ids[:3] and ref.token_ids[3:3 + len(end)] == end  # forced at the budget
    reasoning, answer = get_reasoning_parser("deepseek_r1")().split(ref.text)
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=16, extra_body={"thinking_token_budget": 3})
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    assert reasoning == llm.get_tokenizer().decode(free.token_ids[:3]).strip()
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer


# the default model echoes this, </think> included: its output ends a "reasoning" deterministically
ECHO = [{"role": "user", "content": "Echo: <think>ok</think> done"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


def reference(llm, schema: dict, tools: list | None = None) -> tuple[str, str]:
    """The offline run with the constraint gated on </think>: (reasoning, answer)."""
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema, reasoning_end=end))
    out = llm.chat(ECHO, params, tools=tools)[0].outputs[0]
    assert out.finish_reason == "stop"
    return get_reasoning_parser("deepseek_r1")().split(out.text)


def test_a_named_tool_call_is_constrained_only_after_the_reasoning(client, llm):
    reasoning, arguments = reference(llm, parameters_schema(WEATHER), [{"type": "function", "function": WEATHER}])
    assert reasoning == "Echo: <think>ok" and json.loads(arguments) == {"city": "New York"}
    kw = dict(model=MODEL, messages=ECHO, temperature=0, max_tokens=60,
              tools=[{"type": "function", "function": WEATHER}],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**kw).choices[0]
    call = choice.message.tool_calls[0]
    assert (choice.message.reasoning_content, choice.message.content) == (reasoning, None)
    assert (call.function.name, call.function.arguments, choice.finish_reason) == ("get_weather", arguments,
                                                                                  "tool_calls")
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    thought = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert "".join(thought) == reasoning and not any(d.content for d in deltas)
    assert deltas.index(next(d for d in deltas if d.tool_calls)) > max(
        i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None))  # the reasoning comes first
    assert calls[0].function.name == "get_weather"
    assert "".join(c.function.arguments or "" for c in calls) == arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_response_format_answer_follows_its_reasoning(client, llm):
    reasoning, answer = reference(llm, CITY)
    assert reasoning == "Echo: <think>ok" and json.loads(answer) == {"city": "New York"}
    kw = dict(model=MODEL, messages=ECHO, temperature=0, max_tokens=60,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer


def test_a_constrained_output_that_never_ends_its_reasoning_is_all_reasoning(client, llm):
    """deepseek_r1: the output begins inside the reasoning; this one never writes </think>,
    so it is never constrained (the default model's free answer, all reasoning)."""
    ref = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=5,
                                         extra_body={"guided_choice": ["Paris", "Rome"]})
    assert (out.choices[0].message.reasoning_content, out.choices[0].message.content) == (ref.text, None)


def test_the_responses_api_gives_a_reasoning_item_then_the_constrained_text(client, llm):
    reasoning, answer = reference(llm, CITY)
    out = client.responses.create(model=MODEL, input=ECHO[0]["content"], max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == reasoning and out.output_text == answer
