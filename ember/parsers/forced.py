"""Calls the output is constrained to (tool_choice a named function, or "required"), with
the JSON schema that constrains it, so that any model calls tools with no parser at all:

- a named function: the output is the function's arguments, an object following its
  `parameters` schema; the text is the arguments, as written;
- required: the output is a JSON array of one or more {"name", "parameters"} objects,
  each naming one of the tools and following its schema (one item at most without
  parallel tool calls).
"""

from __future__ import annotations

from typing import Any

from ember.parsers.base import CallScan, Scan, ToolParser, json_array_calls

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function's `parameters` (a function without them takes any object)."""
    return function.get("parameters") or ANY_OBJECT


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The array of calls `tool_choice: "required"` constrains the output to. Each
    function's own $defs move to the root (under the function's position, so two tools'
    definitions never clash) and its references follow them."""
    defs: dict[str, Any] = {}
    items = []
    for i, function in enumerate(functions):
        parameters = _hoist_defs(parameters_schema(function), f"tool{i}.", defs)
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    local = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def moved(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            out = {k: moved(v) for k, v in node.items() if k != "$ref"}
            if isinstance(ref, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(root):
                        ref = "#/$defs/" + prefix + ref[len(root):]
                out["$ref"] = ref
            return out
        return [moved(v) for v in node] if isinstance(node, list) else node

    for name, definition in local.items():
        defs[prefix + name] = moved(definition)
    return {k: moved(v) for k, v in schema.items() if k not in ("$defs", "definitions")}


class NamedCall(ToolParser):
    """The output of a named tool choice: the whole text is the function's arguments."""

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", (CallScan(self.function, text, final),))


class RequiredCalls(ToolParser):
    """The output of tool_choice "required": an array of {"name", "parameters"}. An array cut
    off (max_tokens) keeps the calls it began, the last one's arguments as far as they go."""

    def scan(self, text: str, final: bool) -> Scan:
        calls = json_array_calls(text, final)
        if calls is None:
            calls = json_array_calls(text, False) or []
        return Scan("", tuple(calls))
