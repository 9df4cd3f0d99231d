"""Reasoning parsers: the text a reasoning model writes between <think> and </think> is its
reasoning (`reasoning_content`), the rest its answer (`content`), for whole outputs and
for streams. `--reasoning-parser NAME` on the server; offline:

    from ember.parsers.reasoning import get_reasoning_parser

    reasoning, content = get_reasoning_parser("qwen3")().split(text)

- qwen3: <think>...</think> and then the answer; without </think> (thinking turned off,
  `chat_template_kwargs: {"enable_thinking": false}`) the whole text is the answer.
- deepseek_r1: the template opens <think> in the prompt, so the output may begin inside
  it: everything up to </think> is reasoning; without </think> the whole text is.
- deepseek_v3 (DeepSeek-V3.1) reads as deepseek_r1, glm45 (GLM-4.5 / 4.6) as qwen3, granite
  (Granite 3.3) as qwen3 with the answer's <response> tags taken off.
- gpt_oss: gpt-oss's harmony channels (analysis is the reasoning; parsers/harmony.py).

A structured-output or tool-call constraint starts after the reasoning
(StructuredOutputsParams.reasoning_end): the server gives it where `starts_in_reasoning`
says the output begins inside the reasoning, i.e. where the rendered prompt has not
already closed it (a template that writes an empty <think></think> when thinking is off).
A qwen3 model that thinks writes <think> first; one that does not (and no </think>) is
never constrained, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ember.parsers.base import held_back, registered

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str  # a prefix of the finished reasoning
    content: str  # a prefix of the finished answer


class ReasoningParser:
    name: ClassVar[str] = ""
    always_thinks: ClassVar[bool] = False  # the output begins inside <think> even without the tag
    end: ClassVar[str | None] = END  # what ends the reasoning; None: no one tag does (a constraint cannot wait for it)
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: the text must keep them

    def scan(self, text: str, final: bool) -> Split:
        """What `text` holds so far; a tail that may begin a tag waits unless `final`. Both
        parts are given without leading blank space."""
        lead = text.lstrip()
        opened = lead.startswith(START)
        if not opened and not final and START.startswith(lead):  # the start tag may be being written
            return Split("", "")
        if not opened and not self.always_thinks:
            return Split("", lead)
        body = lead[len(START):] if opened else lead
        end = body.find(END)
        if end < 0:
            return Split((body if final else body[:len(body) - held_back(body, END)]).lstrip(), "")
        return Split(body[:end].lstrip(), body[end + len(END):].lstrip())

    def starts_in_reasoning(self, prompt: str) -> bool:
        """Whether an output that follows `prompt` begins inside the reasoning (or, for
        qwen3, may open it): not where the prompt ends with </think>."""
        return not prompt.rstrip().endswith(END)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        parts = self.scan(text, final=True)
        return parts.reasoning or None, parts.content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_thinks = True


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    """DeepSeek-V3.1's template opens <think> in the prompt when thinking, and closes it there
    (</think>) when not: deepseek_r1's reading, with starts_in_reasoning telling the two apart."""

    name = "deepseek_v3"


class GLM45ReasoningParser(Qwen3ReasoningParser):
    """GLM-4.5 / 4.6 write <think>...</think> first, as Qwen3 does (an empty pair without thinking)."""

    name = "glm45"


RESPONSE, RESPONSE_END = "<response>", "</response>"


class GraniteReasoningParser(Qwen3ReasoningParser):
    """Granite 3.3: its template, with `thinking` on, asks for the thoughts between <think>
    and </think> and the answer between <response> and </response>; the answer is given
    without those tags. (Granite 3.2's "Here is my thought process:" phrases are not read.)"""

    name = "granite"

    def scan(self, text: str, final: bool) -> Split:
        split = super().scan(text, final)
        content = split.content
        if content.startswith(RESPONSE):
            content = content[len(RESPONSE):]
        elif not final and RESPONSE.startswith(content):  # the tag may be being written
            return Split(split.reasoning, "")
        end = content.find(RESPONSE_END)
        if end >= 0:
            content = content[:end] + content[end + len(RESPONSE_END):]
        elif not final:
            content = content[:len(content) - held_back(content, RESPONSE_END)]
        return Split(split.reasoning, content.lstrip() if end < 0 else content.strip())


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (harmony, parsers/harmony.py): the analysis messages before the first other
    message are the reasoning; the rest, from that message on, is left as written for the
    `openai` tool-call parser."""

    name = "gpt_oss"
    end = None
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Split:
        from ember.parsers.harmony import is_harmony, may_become_harmony, messages

        if not is_harmony(text):
            return Split("", "" if not final and may_become_harmony(text) else text.lstrip())
        reasoning = []
        for message in messages(text, final):
            if message.header is None or message.channel != "analysis":
                return Split("".join(reasoning), text[message.start:] if message.header is not None or final else "")
            reasoning.append(message.body)
        return Split("".join(reasoning), "")

    def starts_in_reasoning(self, prompt: str) -> bool:
        return True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser,
                              GLM45ReasoningParser, GraniteReasoningParser, GptOssReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return registered(REASONING_PARSERS, name, "reasoning parser")
