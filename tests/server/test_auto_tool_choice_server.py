"""tool_choice "auto" on a server started with no tool flag and a chat template that offers
tools (hermes-style ChatML, as Qwen2.5's, so the hermes parser is read off it):
the tools and a tool-result round trip are rendered into the prompt as the offline
renderer does (`LLM.chat(tools=...)`), the model's text is read by the hermes parser
(the tiny model answers in prose: it comes back as content), and the other tool
choices work alongside."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from servers import MODEL, post, serving
from test_tool_calls_server import ASK, TOOLS, WEATHER, reassembled

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.parsers import get_tool_parser

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    yield from serving(gguf_path, tmp_path_factory, "--chat-template", str(TEMPLATE))


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def hermes_llm(gguf_path):
    """The same model and template offline."""
    return LLM(str(gguf_path), quantization="none", dtype="float32", chat_template=str(TEMPLATE), num_kv_blocks=128)


def test_llm_chat_renders_the_tools(hermes_llm):
    out = hermes_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=1), tools=TOOLS)[0]
    assert "\n<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>\n" in out.prompt
    assert out.prompt.endswith("<|im_start|>user\nWhat is the weather like in Paris today?<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_a_tool_result_round_trip_renders_the_call_and_the_result(server, client, hermes_llm):
    r = post(server, "/tokenize", {"messages": HISTORY, "tools": TOOLS}).json()
    rendered = hermes_llm.chat(HISTORY, SamplingParams(temperature=0, max_tokens=1), tools=TOOLS)[0]
    assert r["tokens"] == rendered.prompt_token_ids
    assert rendered.prompt.endswith(
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    out = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, temperature=0, max_tokens=30)
    want = hermes_llm.chat(HISTORY, SamplingParams(temperature=0, max_tokens=30), tools=TOOLS)[0].outputs[0].text
    assert out.usage.prompt_tokens == len(r["tokens"])
    assert out.choices[0].message.content == get_tool_parser("hermes")().extract(want).content


def test_auto_reads_the_text_with_the_parser_and_prose_stays_content(client, hermes_llm):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=40)
    choice = client.chat.completions.create(**kw).choices[0]
    text = hermes_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40), tools=TOOLS)[0].outputs[0].text
    assert text == "The weather in Paris today is mostly sunny with a moderate temperature of 22°C (72°F)."
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    assert reassembled(client.chat.completions.create(stream=True, **kw)) == ([], text, "stop")


def test_tool_choice_none_renders_the_tools_and_answers_in_text(server, client):
    with_tools = post(server, "/tokenize", {"messages": ASK, "tools": TOOLS}).json()["count"]
    without = post(server, "/tokenize", {"messages": ASK}).json()["count"]
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                         max_tokens=8)
    assert out.usage.prompt_tokens == with_tools > without + 100
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content


def test_a_named_function_is_constrained_on_this_server_too(client, hermes_llm):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = out.choices[0].message.tool_calls
    parameters = WEATHER["function"]["parameters"]
    want = hermes_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=parameters)), tools=TOOLS)[0].outputs[0].text
    assert (call.function.name, call.function.arguments) == ("get_weather", want)
    jsonschema.validate(json.loads(want), parameters)
    assert out.choices[0].finish_reason == "tool_calls"


def test_chat_template_kwargs_reach_the_template(client, hermes_llm):
    """Qwen3's switch: its template closes an empty <think> block when thinking is off."""
    off = hermes_llm.chat(ASK, SamplingParams(temperature=0, max_tokens=1), tools=TOOLS, enable_thinking=False)[0]
    assert off.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert out.usage.prompt_tokens == len(off.prompt_token_ids) > on.usage.prompt_tokens
