"""Each family's tool-call parser on what that family's own chat template writes for an
assistant turn with content and two calls (templates/: the models' templates): the reasoning
parser first where the template writes <think></think>, then the calls and the content,
whole and streamed; and the parser the server reads off each template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import SandboxedEnvironment
from test_tool_parsers import streamed

from ember.loader.tokenizer import Tokenizer
from ember.parsers import ExtractedToolCalls, FunctionCall, get_tool_parser, infer_tool_parser
from ember.parsers.reasoning import get_reasoning_parser

TEMPLATES = Path(__file__).parent / "templates"
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET", "hours": 3})]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": "Let me check.",
             "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                            for i, (name, args) in enumerate(CALLS)]}]
# parser: (template, where the assistant's turn starts, where it ends, the reasoning parser)
FAMILIES = {
    "deepseek_v31": ("deepseek-ai-DeepSeek-V3.1.jinja", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "deepseek_v3"),
    "kimi_k2": ("Kimi-K2-Instruct.jinja", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>", None),
    "qwen3_coder": ("Qwen3-Coder.jinja", "<|im_start|>assistant\n", "<|im_end|>", None),
    "glm45": ("GLM-4.6.jinja", "<|assistant|>", None, "glm45"),
}


def rendered(template: str) -> str:
    source = (TEMPLATES / template).read_text()
    if template.startswith("Kimi"):  # it appends to a list: transformers' immutable sandbox refuses that
        env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False)
        return env.from_string(source).render(messages=MESSAGES, add_generation_prompt=False)
    tok = Tokenizer.__new__(Tokenizer)  # only the template: no vocabulary needed
    tok._chat_template, tok._bos_token_id, tok._eos_token_id, tok.backend = source, None, None, None
    tok._token_text = lambda token_id: None
    return tok.apply_chat_template(MESSAGES, add_generation_prompt=False)


def assistant_turn(name: str) -> str:
    template, start, end, reasoning = FAMILIES[name]
    text = rendered(template)
    turn = text[text.rindex(start) + len(start):]
    turn = turn[:turn.index(end)] if end else turn
    if reasoning is not None:
        thought, turn = get_reasoning_parser(reasoning)().split(turn)
        assert thought is None  # the template writes an empty <think></think>
    return turn


WANT = ExtractedToolCalls("Let me check.", tuple(FunctionCall(n, json.dumps(a)) for n, a in CALLS))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_families_parser_reads_its_templates_calls(name):
    turn = assistant_turn(name)
    parser = get_tool_parser(name)()
    got = parser.extract(turn)
    assert (got.content.strip(), got.calls) == (WANT.content, WANT.calls)
    for step in (1, 3, 7):
        again = streamed(parser, turn, step)
        assert (again.content.strip(), again.calls) == (WANT.content, WANT.calls), step


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_server_reads_the_parser_off_the_template(name):
    assert infer_tool_parser((TEMPLATES / FAMILIES[name][0]).read_text()) == name


@pytest.mark.parametrize("name,text", [
    ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]"
                "<|tool_call_end|>"),
    ("qwen3_coder", "<tool_call>\nget_weather(Paris)\n</tool_call>"),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_value>\n</tool_call>"),
])
def test_a_call_that_does_not_parse_leaves_the_text_as_content(name, text):
    assert get_tool_parser(name)().extract(text) == ExtractedToolCalls(text)


# -- gpt-oss (harmony): the reasoning parser and the tool-call parser together ----------------

HARMONY = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "string"}}}}}]


def harmony_turn(assistant: dict) -> str:
    """What gpt-oss writes after its generation prompt (<|start|>assistant), as its template
    renders that turn."""
    tok = Tokenizer.__new__(Tokenizer)
    tok._chat_template, tok._bos_token_id, tok._eos_token_id, tok.backend = \
        (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(), None, None, None
    tok._token_text = lambda token_id: None
    prompt = tok.apply_chat_template(HARMONY, tools=WEATHER_TOOL)
    text = tok.apply_chat_template(HARMONY + [assistant], add_generation_prompt=False, tools=WEATHER_TOOL)
    assert prompt.endswith("<|start|>assistant") and text.startswith(prompt[:-len("<|start|>assistant")])
    return text[len(prompt):]


def streamed_harmony(text: str, step: int, max_calls: int | None = None) -> tuple[str, str, list]:
    from ember.parsers import ToolCallStream
    from ember.parsers.reasoning import GptOssReasoningParser
    from ember.server.tool_calls import ChoiceStream

    stream = ChoiceStream(ToolCallStream(get_tool_parser("openai")(), max_calls), GptOssReasoningParser())
    reasoning, content, calls = "", "", {}
    for end in range(step, len(text) + step, step):
        for delta in stream.deltas(text[:end], "", end >= len(text)):
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), args + (call.function.arguments or ""))
    return reasoning, content, [calls[i] for i in sorted(calls)]


def test_gpt_oss_reasoning_then_its_final_answer():
    turn = harmony_turn({"role": "assistant", "thinking": "The user asks; answer.", "content": "It is 18 C."})
    assert turn == ("<|channel|>analysis<|message|>The user asks; answer.<|end|><|start|>assistant<|channel|>final"
                    "<|message|>It is 18 C.<|return|>")
    reasoning, rest = get_reasoning_parser("gpt_oss")().split(turn)
    assert reasoning == "The user asks; answer."
    assert get_tool_parser("openai")().extract(rest) == ExtractedToolCalls("It is 18 C.")
    for step in (1, 4, 9):
        assert streamed_harmony(turn, step) == ("The user asks; answer.", "It is 18 C.", []), step


def test_gpt_oss_calls_a_function_in_the_commentary_channel():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = harmony_turn({"role": "assistant", "content": "", "tool_calls": [call]})
    assert "to=functions.get_weather" in turn and turn.endswith("<|call|>")
    reasoning, rest = get_reasoning_parser("gpt_oss")().split(turn)
    assert reasoning is None
    assert get_tool_parser("openai")().extract(rest) == ExtractedToolCalls(
        None, (FunctionCall("get_weather", '{"city": "Paris"}'),))
    for step in (1, 5, 11):
        assert streamed_harmony(turn, step) == ("", "", [("get_weather", '{"city": "Paris"}')]), step
    assert infer_tool_parser((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()) == "openai"


def test_with_gpt_oss_the_answer_is_read_as_harmony_and_a_constraint_is_refused():
    from ember.server.protocol import ChatCompletionRequest, InvalidRequest
    from ember.server.tool_calls import plan_tools

    plain = plan_tools(ChatCompletionRequest(messages=HARMONY), None, "gpt_oss")
    assert (plain.parser.name, plain.max_calls, plain.keep_special_tokens) == ("openai", 0, True)
    named = ChatCompletionRequest(messages=HARMONY, tools=WEATHER_TOOL,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(InvalidRequest, match="cannot tell apart from the reasoning"):
        plan_tools(named, "openai", "gpt_oss")


# -- Granite 3.3: its template tells the model the formats (it renders no assistant calls) ----

GRANITE = "ibm-granite-granite-3.3-2B-Instruct.jinja"


def granite_prompt(**kwargs) -> str:
    tok = Tokenizer.__new__(Tokenizer)
    tok._chat_template, tok._bos_token_id, tok._eos_token_id, tok.backend = \
        (TEMPLATES / GRANITE).read_text(), None, None, None
    tok._token_text = lambda token_id: None
    return tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], **kwargs)


def test_granite_calls_in_the_format_its_template_asks_for():
    prompt = granite_prompt(tools=WEATHER_TOOL)
    assert "respond only with <|tool_call|> followed by a JSON list of tools used" in prompt
    assert prompt.endswith("<|start_of_role|>assistant<|end_of_role|>")
    assert infer_tool_parser((TEMPLATES / GRANITE).read_text()) == "granite"
    turn = "<|tool_call|>" + json.dumps([{"name": n, "arguments": a} for n, a in CALLS])
    parser = get_tool_parser("granite")()
    assert parser.extract(turn) == ExtractedToolCalls(None, WANT.calls)
    for step in (1, 3, 7):
        assert streamed(parser, turn, step).calls == WANT.calls, step


def test_granite_thinks_and_responds_in_the_tags_its_template_asks_for():
    assert "Write your thoughts between <think></think> and write your response between <response></response>" \
        in granite_prompt(thinking=True)
    turn = "<think>The user wants the weather.</think><response>It is sunny in Paris.</response>"
    parser = get_reasoning_parser("granite")()
    assert parser.split(turn) == ("The user wants the weather.", "It is sunny in Paris.")
    assert parser.split("It is sunny.") == (None, "It is sunny.")  # thinking off: no tags
    for step in (1, 2, 5):
        reasoning = content = ""
        for end in range(step, len(turn) + step, step):
            part = parser.scan(turn[:end], final=end >= len(turn))
            assert part.reasoning.startswith(reasoning) and part.content.startswith(content), (step, end)
            reasoning, content = part.reasoning, part.content
        assert (reasoning, content) == ("The user wants the weather.", "It is sunny in Paris."), step
