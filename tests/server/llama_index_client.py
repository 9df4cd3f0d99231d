"""LlamaIndex's OpenAILike on `ember serve`, as LlamaIndex's docs set it up for vLLM: run by
test_llama_index.py in a virtualenv of its own (`python llama_index_client.py URL KEY MODEL`),
which states every request body this sends. It prints, as JSON, what each call returned and
those bodies, in order. (No `from __future__ import annotations`: LlamaIndex writes a tool's
signature into its description, and would quote its annotations.)"""

import asyncio
import json
import sys
from typing import Literal

import httpx
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel, Field

url, key, model = sys.argv[1:]
ASK = "What is the weather like in Paris today?"
sent = []


def record(request: httpx.Request) -> None:
    sent.append({"path": request.url.path, "body": json.loads(request.content)})


async def arecord(request: httpx.Request) -> None:
    record(request)


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "London", "Rome"] = Field(description="The city")
    unit: Literal["celsius", "fahrenheit"]


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return "sunny"


def llm(is_chat_model: bool, max_tokens: int) -> OpenAILike:
    return OpenAILike(model=model, api_base=f"{url}/v1", api_key=key, is_chat_model=is_chat_model,
                      is_function_calling_model=True, temperature=0, max_tokens=max_tokens, context_window=8192,
                      max_retries=0, timeout=120, http_client=httpx.Client(event_hooks={"request": [record]}),
                      async_http_client=httpx.AsyncClient(event_hooks={"request": [arecord]}))


def calls(llm: OpenAILike, response) -> list[dict]:
    return [{"id": c.tool_id, "name": c.tool_name, "args": c.tool_kwargs}
            for c in llm.get_tool_calls_from_response(response)]


async def streamed_tool_call(llm: OpenAILike, tool: FunctionTool) -> list[dict]:
    """What a FunctionAgent with initial_tool_choice does first: stream a chat with tools, the
    function named, and read the calls off the last chunk."""
    last = None
    async for last in await llm.astream_chat_with_tools([tool], user_msg=ASK, tool_choice="get_weather"):
        pass
    return calls(llm, last)


chat, base = llm(is_chat_model=True, max_tokens=30), llm(is_chat_model=False, max_tokens=8)
tool = FunctionTool.from_defaults(fn=get_weather)
question = [ChatMessage(role="user", content="What is the capital of France?")]
out = {
    "complete": chat.complete("Which city is the capital of Germany?").text,
    "complete_base": base.complete("The capital of France is").text,
    "chat": chat.chat(question).message.content,
    "stream_chat": [r.delta for r in chat.stream_chat(question)],
}
weather = chat.structured_predict(Weather, PromptTemplate("What is the weather like in {city} today?"), city="Paris")
out["structured"] = {"type": type(weather).__name__, "value": weather.model_dump()}
out["tool_calls"] = calls(chat, chat.chat_with_tools([tool], user_msg=ASK, tool_required=True))
out["streamed_tool_calls"] = asyncio.run(streamed_tool_call(chat, tool))
out["sent"] = sent
print(json.dumps(out))
