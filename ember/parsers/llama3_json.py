"""llama3_json: the whole answer is a call, a JSON object with "name" and "parameters",
optionally after <|python_tag|>; several calls are separated by ";" (Llama 3.1-3.3):

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

An answer that begins otherwise is content.
"""

from __future__ import annotations

import json

from ember.parsers.base import CallScan, Scan, ToolParser, json_call, register_tool_parser, whole_call

TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def scan(self, text: str, final: bool) -> Scan:
        lead = text.lstrip()
        if lead.startswith(TAG):
            body = lead[len(TAG):]
        elif lead.startswith("{"):
            body = lead
        elif not final and TAG.startswith(lead):  # blank so far, or the tag being written
            return Scan("")
        else:
            return Scan(text)
        calls = _calls(body, final)
        if calls is None:
            return Scan(text if final else "")
        return Scan("", tuple(calls))


def _calls(body: str, final: bool) -> list[CallScan] | None:
    """The calls in `body` ("{...}; {...}"); None if a final body holds something else."""
    decoder = json.JSONDecoder()
    calls: list[CallScan] = []
    at = _skip_blank(body, 0)
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:  # the last call, still being written
            if final:
                return None
            return calls + [json_call(body[at:], done=False) or CallScan(None, "", False)]
        call = whole_call(obj)
        if call is None:
            return None if final else calls + [CallScan(None, "", True)]
        calls.append(call)
        at = _skip_blank(body, end)
        if at < len(body):
            if body[at] != ";":
                return None if final else calls + [CallScan(None, "", True)]
            at = _skip_blank(body, at + 1)
    if final and not calls:
        return None
    return calls


def _skip_blank(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
