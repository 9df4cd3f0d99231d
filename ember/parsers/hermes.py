"""hermes: each call a JSON object between <tool_call> and </tool_call> (Hermes, Qwen2.5,
Qwen3), after any content:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from ember.parsers.base import CallScan, Scan, ToolParser, content_before, json_call, register_tool_parser

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(START)
        if start < 0:
            return Scan(content_before(text, START, final))
        calls: list[CallScan] = []
        at = start
        while at >= 0:
            body = at + len(START)
            end = text.find(END, body)
            call = json_call(text[body:end if end >= 0 else len(text)], done=final or end >= 0)
            if call is None:  # a call that does not parse: the text is prose after all
                if final:
                    return Scan(text)
                call = CallScan(None, "", True)
            calls.append(call)
            at = text.find(START, end + len(END)) if end >= 0 else -1
        return Scan(text[:start], tuple(calls))
