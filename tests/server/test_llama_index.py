"""LlamaIndex against a real `ember serve` (the default model, no tool flags), set up as
LlamaIndex's docs tell vLLM users: llama-index-llms-openai-like's OpenAILike, a chat and
function-calling model. Its OpenAI integration pins openai<3 and the test extra has 3.x, so it
runs in a virtualenv of its own (tests/venvs.py: built once under ember's cache dir, reused),
in one run of llama_index_client.py for every call: `complete` (through chat, and a base
model's through /v1/completions), `chat`, `stream_chat`, `structured_predict` (function
calling: tool_choice required) and a tool call, required and, streamed, named (as a
FunctionAgent with initial_tool_choice asks first). Every request LlamaIndex sends is the one
written here, and what it makes of each answer is what the official client gets for that
request: the greedy text, the forced call's arguments. A forced call constrains decoding, so
even the tiny model answers with valid calls."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from servers import FRANCE, KEY, MODEL
from venvs import venv_with

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

REQUIREMENTS = ["llama-index-core==0.14.25", "llama-index-llms-openai==0.8.3", "llama-index-llms-openai-like==0.8.1"]
MAX_TOKENS = 30  # the chat model's; the base model's is 8
ASK = "What is the weather like in Paris today?"
QUESTION = "What is the capital of France?"
CHAT = "/v1/chat/completions"


def body(content: str, **more) -> dict:
    return {"messages": [{"role": "user", "content": content}], "model": MODEL, "max_tokens": MAX_TOKENS,
            "stream": False, "temperature": 0.0, **more}


def function(name: str, description: str, properties: dict) -> dict:
    """A tool as LlamaIndex writes one: its schema without title or description, closed, not strict."""
    return {"type": "function", "function": {"name": name, "description": description, "strict": False, "parameters": {
        "properties": properties, "required": list(properties), "type": "object", "additionalProperties": False}}}


WEATHER = function("Weather", "The weather in a city.", {
    "city": {"description": "The city", "enum": ["Paris", "London", "Rome"], "title": "City", "type": "string"},
    "unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}})
GET_WEATHER = function("get_weather", "get_weather(city: str) -> str\nGet the current weather in a city.",
                       {"city": {"title": "City", "type": "string"}})
SENT = [
    (CHAT, body("Which city is the capital of Germany?")),  # complete
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": 8, "stream": False,
                         "temperature": 0.0}),  # complete, is_chat_model=False
    (CHAT, body(QUESTION)),  # chat
    (CHAT, body(QUESTION, stream=True)),  # stream_chat
    (CHAT, body(ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)),  # structured_predict
    (CHAT, body(ASK, tools=[GET_WEATHER], tool_choice="required", parallel_tool_calls=False)),  # chat_with_tools
    (CHAT, body(ASK, tools=[GET_WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=False, stream=True)),  # astream_chat_with_tools
]


@pytest.fixture(scope="module")
def llama_index_python() -> Path:
    return venv_with("llama-index", REQUIREMENTS)


def test_llama_index_openai_like(server, client, llama_index_python):
    script = Path(__file__).with_name("llama_index_client.py")
    try:
        done = subprocess.run([str(llama_index_python), str(script), server.url, KEY, MODEL],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"llama_index_client.py ran past {e.timeout} s:\n{server.log_tail()}")
    assert done.returncode == 0, f"{done.stderr[-5000:]}\n{server.log_tail()}"
    out = json.loads(done.stdout)
    assert [(s["path"], s["body"]) for s in out["sent"]] == SENT

    def answer(sent: dict):
        return client.chat.completions.create(**(sent | {"stream": False})).choices[0].message

    complete, base, chat, _, structured, tools, streamed_tools = (b for _, b in SENT)
    assert out["complete"] == answer(complete).content
    assert out["complete_base"] == client.completions.create(**base).choices[0].text
    assert out["complete_base"].startswith(" Paris.")
    assert out["chat"] == answer(chat).content
    assert len(out["stream_chat"]) > 2 and "".join(out["stream_chat"]) == out["chat"]

    [direct] = answer(structured).tool_calls
    assert out["structured"] == {"type": "Weather", "value": json.loads(direct.function.arguments)}
    assert out["structured"]["value"]["city"] in ("Paris", "London", "Rome")
    assert out["structured"]["value"]["unit"] in ("celsius", "fahrenheit")

    for got, sent in ((out["tool_calls"], tools), (out["streamed_tool_calls"], streamed_tools)):
        [call] = got
        [direct] = answer(sent).tool_calls
        assert call["name"] == direct.function.name == "get_weather"
        assert call["args"] == json.loads(direct.function.arguments)
        assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
        assert call["id"].startswith("call_")
