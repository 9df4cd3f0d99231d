"""The agent libraries themselves against a real `ember serve` (the default model, no tool
flags): langchain-openai's `with_structured_output(method="function_calling")` and
`bind_tools` with a named tool, pydantic-ai's default structured output (a final_result
tool, tool_choice required), through both its chat and its Responses model, and openai-agents'
structured output and a required function tool, through both of its models too. A named tool or
`required` constrains decoding, so even the tiny model answers with valid calls. (instructor
pins an older openai client: tests/server/test_tool_calls_server.py sends what it sends.
LlamaIndex's OpenAI integration pins openai<3: test_llama_index.py runs it in a virtualenv of
its own.)"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from servers import KEY, MODEL

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

ASK = "What is the weather like in Paris today?"


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "London", "Rome"] = Field(description="The city")
    unit: Literal["celsius", "fahrenheit"]


def test_langchain_structured_output_and_a_named_bound_tool(server, client):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0,
                                       max_tokens=60)
    weather = chat.with_structured_output(Weather, method="function_calling").invoke(ASK)
    assert isinstance(weather, Weather)
    direct = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0, max_tokens=60,
        tools=[{"type": "function", "function": {"name": "Weather", "description": "The weather in a city.",
                                                 "parameters": Weather.model_json_schema()}}],
        tool_choice={"type": "function", "function": {"name": "Weather"}})
    assert weather == Weather.model_validate_json(direct.choices[0].message.tool_calls[0].function.arguments)

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_default_structured_output(server, api):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{server.url}/v1", api_key=KEY)
    model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(MODEL, provider=provider)
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0.0, "max_tokens": 60})
    result = agent.run_sync(ASK)
    assert result.output == Weather(city="Paris", unit="celsius")  # the tiny model's greedy call
    assert result.usage.output_tokens > 0


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_structured_output_and_a_required_tool(server, api):
    """openai-agents (its default Responses model, and its chat-completions one): an agent's
    structured output (a json_schema text format) parses into its output type, and an agent
    that must call its function tool runs it and stops with the tool's result."""
    pytest.importorskip("agents")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    openai_client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel)(MODEL, openai_client)
    settings = ModelSettings(temperature=0.0, max_tokens=60)
    agent = Agent("forecaster", instructions="Answer with the weather.", model=model, output_type=Weather,
                  model_settings=settings)
    result = Runner.run_sync(agent, ASK)
    assert isinstance(result.final_output, Weather)
    assert result.context_wrapper.usage.output_tokens > 0
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    agent = Agent("caller", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0.0, max_tokens=60, tool_choice="required"))
    result = Runner.run_sync(agent, ASK)
    [city] = asked
    assert isinstance(city, str) and result.final_output == f"sunny in {city}"
