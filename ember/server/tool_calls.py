"""Tool calling on /v1/chat/completions: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` ask for (a `ToolPlan`), and the answer's `tool_calls` (after its
`reasoning_content`, split off first with --reasoning-parser).

    tool_choice      the template gets   the output is                    read by
    (no tools)       -                   text                             -
    "none"           the tools           text                             -
    "auto" (default) the tools           text, maybe with calls           auto_tool_parser
    "required"       the tools           a JSON array of calls            forced.RequiredCalls
    {function: f}    the tools           f's arguments (JSON)             forced.NamedCall

"required" and a named function constrain decoding to the calls' JSON through the
structured-output backend, so they work with any model and no server flag, as in vLLM;
"auto" needs no flag either, as in llama.cpp: its parser is `--tool-call-parser`, else the
one whose call marker the chat template writes (`infer_tool_parser`: hermes where it
writes none); `--no-auto-tool-choice` refuses it. An answer with calls has `content` null
(or the text before them, for "auto") and `finish_reason` "tool_calls"; a stream sends each
call's id and name first, then its arguments in pieces that add up to the unstreamed
answer's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ember.loader.tokenizer import Tokenizer
from ember.outputs import CompletionOutput
from ember.parsers import get_tool_parser, infer_tool_parser
from ember.parsers.base import ToolCallStream, ToolParser, new_call_id
from ember.parsers.forced import NamedCall, RequiredCalls, parameters_schema, required_schema
from ember.parsers.reasoning import END, GptOssReasoningParser, ReasoningParser, get_reasoning_parser
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.server import protocol as p

AUTO_REFUSED = ('"auto" tool choice is off on this server (--no-auto-tool-choice): send tool_choice "none", '
                '"required" or a named function')

logger = logging.getLogger("ember.server")


@functools.lru_cache(maxsize=64)
def auto_tool_parser(configured: str | None, chat_template: str | None) -> str | None:
    """The parser of tool_choice "auto" answers: the server's --tool-call-parser, else the one
    the chat template shows (logged the first time); None where "auto" is off."""
    if configured is not None:
        return configured or None
    name = infer_tool_parser(chat_template)
    logger.info('tool_choice "auto": the %s tool-call parser, read off the chat template (--tool-call-parser '
                'overrides it)', name)
    return name

_TOOLS = TypeAdapter(list[p.ChatTool])


def checked_tools(value: Any) -> list[dict[str, Any]] | None:
    """A request's `tools` as the chat template takes them (OpenAI's shape, as sent); None
    for none. InvalidRequest for a tool that is not a function definition."""
    if value is None or value == []:
        return None
    try:
        tools = _TOOLS.validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(x) for x in error.get("loc", ()))
        raise p.InvalidRequest(f"tools: {where + ': ' if where else ''}{error.get('msg')}", "tools") from None
    names = [tool.function.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise p.InvalidRequest(f"tools: each function needs its own name; {', '.join(repeated)!s:.200} is given "
                               "more than once", "tools")
    return [tool.model_dump(exclude_unset=True) for tool in tools]


def _finish_reason(c: CompletionOutput, called: bool) -> str:
    if called and c.finish_reason == "stop":
        return "tool_calls"
    return c.finish_reason or "abort"


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools. The default is a plain chat."""

    tools: list[dict[str, Any]] | None = None  # for the chat template
    constraint: StructuredOutputsParams | None = None  # the calls' JSON ("required", a named function)
    parser: Callable[[], ToolParser] | None = None  # reads calls out of the text; None: the text is content
    max_calls: int | None = None  # 1 without parallel tool calls
    keep_special_tokens: bool = False  # the parser's markers are special tokens
    reasoning: Callable[[], ReasoningParser] | None = None  # splits off the reasoning first (--reasoning-parser)
    include_reasoning: bool = True  # false: the reasoning is split off and dropped
    echo: str = ""  # vLLM's echo: the answer's content starts with it
    as_ids: bool = False  # logprobs name tokens "token_id:ID" (return_tokens_as_token_ids)

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, Any] = {}
        if self.constraint is not None:
            if params.structured_outputs is not None:
                raise p.InvalidRequest("tool_choice constrains the output to the tool call's JSON: give no other "
                                       "output constraint (response_format, structured_outputs, guided_*)",
                                       "tool_choice")
            changes["structured_outputs"] = self.constraint
        if self.keep_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def gate_reasoning(self, params: SamplingParams, prompt: str, tokenizer: Tokenizer,
                       thinking_token_budget: int | None = None) -> tuple[SamplingParams, ToolPlan]:
        """With a reasoning parser, a constrained output (tool calls, response_format, ...)
        is constrained only after </think> where the prompt leaves it inside the reasoning,
        and a thinking budget forces </think> once the output has that many tokens; where the
        prompt closed the reasoning the output is all answer (no split, no budget)."""
        so = params.structured_outputs
        if self.reasoning is not None and self.reasoning.end is None and (so is not None or thinking_token_budget
                                                                          is not None):
            name = "thinking_token_budget" if so is None else "response_format"
            raise p.InvalidRequest(f"{name} needs the end of the reasoning as one tag, which the "
                                   f"{self.reasoning.name} reasoning parser does not have", name)
        if thinking_token_budget is not None and self.reasoning is None:
            raise p.InvalidRequest("thinking_token_budget needs to know where the reasoning ends: start the server "
                                   "with --reasoning-parser", "thinking_token_budget")
        if self.reasoning is None or (so is None and thinking_token_budget is None):
            return params, self
        if not self.reasoning().starts_in_reasoning(prompt):
            return params, dataclasses.replace(self, reasoning=None)
        end = tokenizer.encode(END, add_special_tokens=False)
        changes: dict[str, Any] = {}
        if so is not None:
            changes["structured_outputs"] = dataclasses.replace(so, reasoning_end=end)
        if thinking_token_budget is not None:
            changes.update(thinking_token_budget=thinking_token_budget, thinking_end_token_ids=end)
        return dataclasses.replace(params, **changes), self

    def message(self, c: CompletionOutput) -> tuple[p.ChatMessageOut, str]:
        """One finished choice's message and finish_reason."""
        reasoning, answer = None, c.text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning().split(c.text)
            reasoning = reasoning if self.include_reasoning else None
        if self.parser is None:
            return (p.ChatMessageOut(content=self._echoed(answer), reasoning_content=reasoning),
                    _finish_reason(c, False))
        result = self.parser().extract(answer or "", self.max_calls)
        calls = [p.ToolCall(id=new_call_id(), function=p.FunctionCallOut(name=call.name, arguments=call.arguments))
                 for call in result.calls]
        return (p.ChatMessageOut(content=self._echoed(result.content), reasoning_content=reasoning,
                                 tool_calls=calls or None), _finish_reason(c, bool(calls)))

    def _echoed(self, content: str | None) -> str | None:
        return self.echo + (content or "") if self.echo else content

    def stream(self) -> ChoiceStream:
        return ChoiceStream(ToolCallStream(self.parser(), self.max_calls) if self.parser is not None else None,
                            self.reasoning() if self.reasoning is not None else None, self.include_reasoning)


NO_TOOLS = ToolPlan()


class ChoiceStream:
    """One streamed choice's deltas: its new text as content, or through the parsers (the
    reasoning's, then the tool calls')."""

    def __init__(self, calls: ToolCallStream | None, reasoning: ReasoningParser | None = None,
                 include_reasoning: bool = True) -> None:
        self._calls = calls
        self._reasoning = reasoning
        self._include_reasoning = include_reasoning
        self._sent = [0, 0]  # characters of reasoning and of answer sent (with a reasoning parser)

    def deltas(self, text: str, new_text: str, final: bool) -> list[p.DeltaMessage]:
        """`text`: all of the choice's text sent so far, `new_text` its end not sent before."""
        out = []
        if self._reasoning is not None:
            split = self._reasoning.scan(text, final)
            thought, text = split.reasoning[self._sent[0]:], split.content
            new_text = text[self._sent[1]:]
            self._sent = [max(self._sent[0], len(split.reasoning)), max(self._sent[1], len(text))]
            if thought and self._include_reasoning:
                out.append(p.DeltaMessage(reasoning_content=thought))
        if self._calls is None:
            return out + ([p.DeltaMessage(content=new_text)] if new_text else [])
        if self._reasoning is not None and not text and not final:
            return out  # a named call's name waits for its answer: the calls follow the reasoning
        update = self._calls.update(text, final)
        if update.content:
            out.append(p.DeltaMessage(content=update.content))
        for d in update.tool_calls:
            call = p.DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                   function=p.DeltaFunctionCall(name=d.name, arguments=d.arguments))
            out.append(p.DeltaMessage(tool_calls=[call]))
        return out

    def finish_reason(self, c: CompletionOutput) -> str:
        return _finish_reason(c, self._calls is not None and bool(self._calls.ids))


def plan_tools(body: p.ChatCompletionRequest, auto_parser: str | None, reasoning_parser: str | None = None) -> ToolPlan:
    """What the request's tool fields ask for; `auto_parser`: the parser of "auto" answers
    (auto_tool_parser), None where "auto" is off; `reasoning_parser`:
    --reasoning-parser (a constrained output's constraint then starts after the reasoning:
    see gate_reasoning)."""
    plan = _plan_tools(body, auto_parser)
    if reasoning_parser is None:
        return plan
    reasoning = get_reasoning_parser(reasoning_parser)
    if reasoning.end is None and plan.constraint is not None:
        raise p.InvalidRequest(f"tool_choice {_shown(body.tool_choice)} constrains the answer, which the "
                               f"{reasoning_parser} reasoning parser cannot tell apart from the reasoning by one tag: "
                               "send tool_choice auto or none", "tool_choice")
    plan = dataclasses.replace(plan, reasoning=reasoning,
                               keep_special_tokens=plan.keep_special_tokens or reasoning.keeps_special_tokens)
    if reasoning is GptOssReasoningParser and plan.parser is None:  # the answer is harmony too: its content
        plan = dataclasses.replace(plan, parser=get_tool_parser("openai"), max_calls=0)
    return plan


def _plan_tools(body: p.ChatCompletionRequest, auto_parser: str | None) -> ToolPlan:
    tools = checked_tools(body.tools)
    choice = body.tool_choice
    if tools is None:
        if choice == "required" or isinstance(choice, p.NamedToolChoice):
            raise p.InvalidRequest(f"tool_choice {_shown(choice)} needs tools to choose from", "tool_choice")
        return NO_TOOLS
    choice = "auto" if choice is None else choice  # OpenAI's default when tools are given
    max_calls = None if body.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        if auto_parser is None:
            raise p.InvalidRequest(AUTO_REFUSED, "tool_choice")
        parser = get_tool_parser(auto_parser)
        return ToolPlan(tools, parser=parser, max_calls=max_calls, keep_special_tokens=parser.keeps_special_tokens)
    functions = [tool["function"] for tool in tools]
    if choice == "required":
        return ToolPlan(tools, _constraint(required_schema(functions, body.parallel_tool_calls)), RequiredCalls,
                        max_calls)
    name = choice.function.name
    function = next((f for f in functions if f["name"] == name), None)
    if function is None:
        raise p.InvalidRequest(f"tool_choice names the function {name!r:.100}, which is not among the tools",
                               "tool_choice")
    return ToolPlan(tools, _constraint(parameters_schema(function)), functools.partial(NamedCall, name))


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise p.InvalidRequest(f"tools: {e}", "tools") from None


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {{'name': {choice.function.name!r:.100}}}}}"
