"""deepseek_v31: DeepSeek-V3.1's calls, each its name and its JSON arguments between
markers, in one section after any content (as its chat template writes them):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from ember.parsers.base import Scan, ToolParser, marked_calls, register_tool_parser

SECTION, BEGIN, SEP, END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(ToolParser):
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        return marked_calls(text, final, SECTION, BEGIN, SEP, END, lambda name: name.strip() or None)
