"""glm45: GLM-4.5's and 4.6's calls, one <tool_call> block each: the name, then each
argument's key and value (text; JSON where it is not a string), after any content:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
"""

from __future__ import annotations

import re

from ember.parsers.base import CallScan, Scan, ToolParser, register_tool_parser, tagged_calls, xml_arguments

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_ARGUMENTS = re.compile(r"(\s*<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>)*\s*", re.S)


def _call(block: str, done: bool) -> CallScan | None:
    block = block.lstrip()
    ends = [i for i in (block.find("\n"), block.find("<arg_key>")) if i >= 0] + ([len(block)] if done else [])
    if not ends:  # the name is still being written
        return CallScan(None, "", False)
    name, rest = block[:min(ends)].strip(), block[min(ends):]
    if not name or (done and not _ARGUMENTS.fullmatch(rest)):
        return None if done else CallScan(None, "", False)
    return CallScan(name, xml_arguments([(k.strip(), v) for k, v in _PAIR.findall(rest)], done), done)


@register_tool_parser("glm45")
class GLM45ToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        return tagged_calls(text, final, START, END, _call)
