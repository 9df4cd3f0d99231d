"""mistral: [TOOL_CALLS] and then a JSON array of calls (Mistral 7B v0.3, Mistral Nemo):

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`MarkedArrayToolParser` is the format for any marker (granite.py's).
"""

from __future__ import annotations

from typing import ClassVar

from ember.parsers.base import Scan, ToolParser, content_before, json_array_calls, register_tool_parser


class MarkedArrayToolParser(ToolParser):
    """Content, then one of `markers`, then a JSON array of {"name", "arguments"} calls."""

    markers: ClassVar[tuple[str, ...]]

    def scan(self, text: str, final: bool) -> Scan:
        found = [(at, m) for m in self.markers if (at := text.find(m)) >= 0]
        if not found:
            return Scan(min((content_before(text, m, final) for m in self.markers), key=len))
        start, marker = min(found)
        calls = json_array_calls(text[start + len(marker):].strip(), final)
        if calls is None:
            return Scan(text)
        return Scan(text[:start], tuple(calls))


@register_tool_parser("mistral")
class MistralToolParser(MarkedArrayToolParser):
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token
    markers = ("[TOOL_CALLS]",)
