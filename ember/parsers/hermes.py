"""hermes: each call a JSON object between <tool_call> and </tool_call> (Hermes, Qwen2.5,
Qwen3), after any content:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from ember.parsers.base import Scan, ToolParser, json_call, register_tool_parser, tagged_calls

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        return tagged_calls(text, final, START, END, json_call)
