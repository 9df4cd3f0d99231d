"""kimi_k2: Kimi-K2's calls, each `functions.NAME:INDEX` and its JSON arguments between
markers, in one section after any content (as its chat template writes them):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re

from ember.parsers.base import Scan, ToolParser, marked_calls, register_tool_parser

SECTION, BEGIN = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
SEP, END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_CALL_ID = re.compile(r"\s*(?:functions\.)?([\w.\-]+?)(?::\d+)?\s*")


def _name(call_id: str) -> str | None:
    match = _CALL_ID.fullmatch(call_id)
    return match.group(1) if match else None


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(ToolParser):
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        return marked_calls(text, final, SECTION, BEGIN, SEP, END, _name)
