"""Tool-call parsers, used by the server (`--tool-call-parser NAME` with `tool_choice: auto`)
and offline on `LLM.chat` outputs:

    from ember.parsers import get_tool_parser

    parser = get_tool_parser("hermes")()
    result = parser.extract(output.outputs[0].text)   # .content, .calls[i].name / .arguments

One file per format; `base.py` holds the shapes, the registry and the streaming;
`forced.py` the calls a constraint forces (a named function, "required"); `reasoning.py`
the <think> splitters (`--reasoning-parser`).
"""

from __future__ import annotations

from ember.parsers import hermes, llama3_json, mistral, pythonic  # noqa: F401 (they register themselves)
from ember.parsers.base import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    FunctionCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    registered,
)

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "FunctionCall", "ToolCallDelta", "ToolCallStream", "ToolParser",
           "get_tool_parser"]


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the choices otherwise."""
    return registered(TOOL_PARSERS, name, "tool call parser")
