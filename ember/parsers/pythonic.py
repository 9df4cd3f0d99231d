"""pythonic: the whole answer is a Python list of calls with keyword arguments (Llama 3.2,
Llama 4, ToolACE), read with Python's `ast` (literals only, nothing is evaluated):

    [get_weather(city="Paris"), get_time(zone="CET", hours=24)]

An answer that begins otherwise, or that is not such a list, is content. While it is being
written, each call is given once its closing parenthesis has come.
"""

from __future__ import annotations

import ast
import io
import json
import tokenize

from ember.parsers.base import CallScan, Scan, ToolParser, register_tool_parser


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def scan(self, text: str, final: bool) -> Scan:
        lead = text.strip()
        if not lead:
            return Scan(text if final else "")
        if not lead.startswith("["):
            return Scan(text)
        if final:
            calls = _calls(lead)
            return Scan("", tuple(calls)) if calls else Scan(text)
        ends = _call_ends(lead)
        calls = _calls(lead[:ends[-1]] + "]") if ends else None
        return Scan("", tuple(calls or ()))


def _calls(source: str) -> list[CallScan] | None:
    """The calls of a list of calls; None if `source` is anything else."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(CallScan(node.func.id, json.dumps(arguments, ensure_ascii=False), True))
        except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set, bytes)
            return None
    return calls


def _call_ends(source: str) -> list[int]:
    """Offsets just past each call of the list `source` begins whose closing parenthesis
    has come (Python's tokenizer finds them, so brackets inside strings do not count)."""
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    ends, depth = [], 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.OP:
                continue
            if token.string in "([{":
                depth += 1
            elif token.string in ")]}":
                depth -= 1
                if depth == 1 and token.string == ")":
                    ends.append(line_starts[token.end[0] - 1] + token.end[1])
    except (tokenize.TokenError, SyntaxError):  # the text stops inside a string or bracket
        pass
    return ends
