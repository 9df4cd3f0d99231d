"""internlm: InternLM2 / 2.5's plugin call, a JSON object with "name" and "parameters"
between <|action_start|><|plugin|> and <|action_end|>, after any content:

    Let me check.<|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

Its chat template (ChatML) shows no call format, so the server does not infer it: pass
`--tool-call-parser internlm` (as vLLM asks for its internlm2 parser).
"""

from __future__ import annotations

from ember.parsers.base import Scan, ToolParser, json_call, register_tool_parser, tagged_calls

START, END = "<|action_start|><|plugin|>", "<|action_end|>"


@register_tool_parser("internlm")
class InternLMToolParser(ToolParser):
    keeps_special_tokens = True  # the action tokens are special tokens

    def scan(self, text: str, final: bool) -> Scan:
        return tagged_calls(text, final, START, END, json_call)
