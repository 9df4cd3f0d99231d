"""Reasoning parsers on canned text (as Qwen3 and DeepSeek-R1 write it): the reasoning and
the answer of a whole output, and the same text streamed through the server's choice
stream (reasoning first, then the answer's content or tool calls), whose deltas add up
to the whole split."""

from __future__ import annotations

import functools

import pytest

from ember import SamplingParams
from ember.outputs import CompletionOutput
from ember.parsers import get_tool_parser
from ember.parsers.forced import NamedCall
from ember.parsers.reasoning import REASONING_PARSERS, get_reasoning_parser
from ember.server import protocol as p
from ember.server.tool_calls import ToolPlan, plan_tools

THINK = "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\nThe capital of France is Paris."
CASES = [
    ("qwen3", THINK, ("The user asks for the capital of France. That is Paris.\n", "The capital of France is Paris.")),
    ("qwen3", "The capital of France is Paris.", (None, "The capital of France is Paris.")),  # thinking turned off
    ("qwen3", "<think>\nStill thinking about it", ("Still thinking about it", None)),  # cut off
    ("qwen3", "Use <b>bold</b>.", (None, "Use <b>bold</b>.")),
    ("deepseek_r1", "Paris is in France.\n</think>\n\nParis.", ("Paris is in France.\n", "Paris.")),  # <think> in the prompt
    ("deepseek_r1", THINK, ("The user asks for the capital of France. That is Paris.\n", "The capital of France is Paris.")),
    ("deepseek_r1", "Thinking, cut off", ("Thinking, cut off", None)),
]


@pytest.mark.parametrize("name,text,want", CASES)
def test_the_whole_text_splits_into_reasoning_and_answer(name, text, want):
    assert get_reasoning_parser(name)().split(text) == want


def streamed(plan: ToolPlan, text: str, step: int) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    stream = plan.stream()
    reasoning, content, names, arguments = "", "", {}, {}
    for end in range(step, len(text) + step, step):
        for delta in stream.deltas(text[:end], text[max(0, end - step):end], end >= len(text)):
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                names.setdefault(call.index, call.function.name)
                arguments[call.index] = arguments.get(call.index, "") + call.function.arguments
    return reasoning or None, content or None, [(names[i], arguments[i]) for i in sorted(names)]


def unstreamed(plan: ToolPlan, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    message, finish = plan.message(CompletionOutput(0, text, [], finish_reason="stop"))
    assert finish == ("tool_calls" if message.tool_calls else "stop")
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.reasoning_content, message.content, calls


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("name,text,want", CASES)
def test_streamed_reasoning_adds_up_to_the_split(name, text, want, step):
    plan = ToolPlan(reasoning=get_reasoning_parser(name))
    assert streamed(plan, text, step) == unstreamed(plan, text) == (*want, [])


@pytest.mark.parametrize("step", [1, 3])
def test_reasoning_then_a_tool_call(step):
    text = ('<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    plan = ToolPlan(parser=get_tool_parser("hermes"), reasoning=get_reasoning_parser("qwen3"))
    want = ("I need the weather tool.\n", None, [("get_weather", '{"city": "Paris"}')])
    assert streamed(plan, text, step) == unstreamed(plan, text) == want


def test_the_server_gates_a_constrained_output_on_the_end_of_the_reasoning(llm):
    """With --reasoning-parser every chat plan splits off the reasoning; a constrained one
    gets reasoning_end = </think>'s ids where the prompt leaves the output in its reasoning,
    and neither gate nor split where the prompt closed it (thinking turned off)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ask = [{"role": "user", "content": "hi"}]
    tok = llm.get_tokenizer()

    def plan(**fields):
        return plan_tools(p.ChatCompletionRequest(messages=ask, **fields), None, "qwen3")

    for fields in ({}, {"tools": tools, "tool_choice": "none"}, {"response_format": {"type": "text"}},
                   {"tools": tools, "tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        assert plan(**fields).reasoning is REASONING_PARSERS["qwen3"]
    assert plan_tools(p.ChatCompletionRequest(messages=ask), None).reasoning is None
    required = plan(tools=tools, tool_choice="required")
    params = required.sampling_params(SamplingParams())
    gated, same = required.gate_reasoning(params, "<|im_start|>assistant\n", tok)
    assert same is required and gated.structured_outputs.reasoning_end == (9617, 17400, 46)
    assert tok.decode(list(gated.structured_outputs.reasoning_end)) == "</think>"
    assert gated.structured_outputs.json == params.structured_outputs.json
    closed, unsplit = required.gate_reasoning(params, "<|im_start|>assistant\n<think>\n\n</think>\n\n", tok)
    assert closed is params and unsplit.reasoning is None
    free = plan()
    assert free.gate_reasoning(SamplingParams(), "<|im_start|>assistant\n", tok) == (SamplingParams(), free)


@pytest.mark.parametrize("step", [1, 4])
def test_a_named_call_streams_after_its_reasoning(step):
    text = 'Checking the city.</think>\n{"city": "Paris"}'
    plan = ToolPlan(parser=functools.partial(NamedCall, "get_weather"), reasoning=get_reasoning_parser("deepseek_r1"))
    stream, kinds = plan.stream(), []
    for end in range(step, len(text) + step, step):
        for delta in stream.deltas(text[:end], text[max(0, end - step):end], end >= len(text)):
            kinds.append("reasoning" if delta.reasoning_content else "call" if delta.tool_calls else "other")
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    want = ("Checking the city.", None, [("get_weather", '{"city": "Paris"}')])
    assert streamed(plan, text, step) == unstreamed(plan, text) == want


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser .r2.: choose one of deepseek_r1, deepseek_v3, glm45, gpt_oss, granite, qwen3"):
        get_reasoning_parser("r2")
