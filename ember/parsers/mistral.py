"""mistral: [TOOL_CALLS] and then a JSON array of calls (Mistral 7B v0.3, Mistral Nemo):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from ember.parsers.base import Scan, ToolParser, content_before, json_array_calls, register_tool_parser

MARKER = "[TOOL_CALLS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(MARKER)
        if start < 0:
            return Scan(content_before(text, MARKER, final))
        calls = json_array_calls(text[start + len(MARKER):].strip(), final)
        if calls is None:
            return Scan(text)
        return Scan(text[:start], tuple(calls))
