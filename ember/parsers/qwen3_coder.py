"""qwen3_coder: Qwen3-Coder's XML calls, one <tool_call> block each, a parameter's value
as text (JSON where it is not a string), after any content:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import re

from ember.parsers.base import CallScan, Scan, ToolParser, register_tool_parser, tagged_calls, xml_arguments

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _call(block: str, done: bool) -> CallScan | None:
    head = _FUNCTION.match(block)
    if head is None:
        return None if done else CallScan(None, "", False)
    pairs = [(m.group(1).strip(), m.group(2)) for m in _PARAMETER.finditer(block, head.end())]
    closed = done or "</function>" in block
    if closed and not re.fullmatch(r"(\s*<parameter=[^>\n]+>.*?</parameter>)*\s*(</function>\s*)?",
                                   block[head.end():], re.S):
        return None
    return CallScan(head.group(1).strip(), xml_arguments(pairs, closed), closed)


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        return tagged_calls(text, final, START, END, _call)
