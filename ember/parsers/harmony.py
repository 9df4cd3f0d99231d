"""gpt-oss's harmony format: the output is a run of messages, each a header (its channel,
and for a call its recipient) and a body, ended by <|end|>, <|call|> or <|return|>:

    <|channel|>analysis<|message|>Let me look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    ... or ...<|start|>assistant<|channel|>final<|message|>It is 18 C.<|return|>

(the first message's <|start|>assistant is the generation prompt's). Two parsers read it:
the reasoning parser `gpt_oss` takes the analysis messages before the first other one as
the reasoning and leaves the rest as it is; the tool-call parser `openai` reads that rest:
a message to functions.NAME is a call (its body the JSON arguments), the final channel's
and recipient-less commentary bodies are the content."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ember.parsers.base import CallScan, Scan, ToolParser, held_back, json_arguments, register_tool_parser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")


@dataclass(frozen=True)
class Message:
    start: int  # where it begins in the text (at its <|start|>, if it has one)
    header: str | None  # None until <|message|> is written
    body: str  # so far, without a tail that may begin its end marker
    done: bool

    @property
    def channel(self) -> str:
        at = (self.header or "").find(CHANNEL)
        return (self.header or "")[at + len(CHANNEL):].split()[0] if at >= 0 and self.header[at + len(CHANNEL):].split() \
            else ""

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header or "")
        return match.group(1) if match else None


def messages(text: str, final: bool) -> list[Message]:
    out, pos = [], 0
    while pos < len(text):
        start = pos
        if text.startswith(START, pos):
            pos += len(START)
        at = text.find(MESSAGE, pos)
        if at < 0:
            out.append(Message(start, None, "", final))
            break
        body = at + len(MESSAGE)
        found = [(i, marker) for marker in ENDS if (i := text.find(marker, body)) >= 0]
        if not found:
            rest = text[body:]
            cut = 0 if final else max(held_back(rest, marker) for marker in ENDS)
            out.append(Message(start, text[pos:at], rest[:len(rest) - cut], final))
            break
        end, marker = min(found)
        out.append(Message(start, text[pos:at], text[body:end], True))
        pos = end + len(marker)
    return out


def is_harmony(text: str) -> bool:
    return CHANNEL in text or MESSAGE in text or text.lstrip().startswith(("to=", "<|"))


def may_become_harmony(text: str) -> bool:
    """A text too short to say (a stream's first characters): it may yet begin a header."""
    lead = text.lstrip()
    return any(start.startswith(lead) for start in ("to=", "<|"))


@register_tool_parser("openai")
class HarmonyToolParser(ToolParser):
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        if not is_harmony(text):
            if not final and may_become_harmony(text):
                return Scan("")
            return Scan(text if final else text[:len(text) - held_back(text, CHANNEL)])
        content, calls = "", []
        for message in messages(text, final):
            recipient = message.recipient
            if message.header is None:  # its header is being written
                if final:
                    return Scan(text)
                if recipient is not None or "functions" in text[message.start:]:
                    calls.append(CallScan(None, "", False))
                break
            if recipient is not None and recipient.startswith("functions."):
                arguments = json_arguments(message.body, message.done)
                if arguments is None:
                    return Scan(text)
                calls.append(CallScan(recipient.removeprefix("functions."), arguments, message.done))
            elif message.channel == "final" or (message.channel == "commentary" and recipient is None):
                content += message.body
        return Scan(content, tuple(calls))
