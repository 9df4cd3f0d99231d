"""Tool-call parsers, used by the server (for `tool_choice: auto`: `--tool-call-parser NAME`, or
the one `infer_tool_parser` reads off the chat template) and offline on `LLM.chat` outputs:

    from ember.parsers import get_tool_parser

    parser = get_tool_parser("hermes")()
    result = parser.extract(output.outputs[0].text)   # .content, .calls[i].name / .arguments

One file per format; `base.py` holds the shapes, the registry and the streaming;
`forced.py` the calls a constraint forces (a named function, "required"); `reasoning.py`
the <think> splitters (`--reasoning-parser`).
"""

from __future__ import annotations

from ember.parsers import (  # noqa: F401 (they register themselves)
    deepseek_v31,
    glm45,
    granite,
    harmony,
    hermes,
    internlm,
    kimi_k2,
    llama3_json,
    mistral,
    pythonic,
    qwen3_coder,
)
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
           "get_tool_parser", "infer_tool_parser"]

# what a chat template writes for a call, and the parser that reads it (the first found wins)
TEMPLATE_MARKERS = (
    ("<|channel|>", "openai"),  # gpt-oss's harmony
    ("<｜tool▁calls▁begin｜>", "deepseek_v31"),  # DeepSeek-V3.1
    ("<|tool_calls_section_begin|>", "kimi_k2"),  # Kimi-K2
    ("<function=", "qwen3_coder"),  # Qwen3-Coder's XML (its template writes <tool_call> too)
    ("<arg_key>", "glm45"),  # GLM-4.5 / 4.6 (likewise)
    ("[TOOL_CALLS]", "mistral"),  # Mistral's control token
    ("<|tool_call|>", "granite"),  # Granite 3.x
    ("[func_name1(", "pythonic"),  # Llama 3.2's and 4's pythonic instructions
    ("<|python_tag|>", "llama3_json"),  # Llama 3.1 / 3.2
    ("<tool_call>", "hermes"),  # Qwen2.5, Qwen3, Hermes, SmolLM3
)
DEFAULT_TOOL_PARSER = "hermes"  # a template that shows no call format: ChatML models mostly write hermes calls


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError naming the choices otherwise."""
    return registered(TOOL_PARSERS, name, "tool call parser")


def infer_tool_parser(chat_template: str | None) -> str:
    """The parser of the calls a model with this chat template writes: the first of
    TEMPLATE_MARKERS the template contains, else DEFAULT_TOOL_PARSER."""
    return next((name for marker, name in TEMPLATE_MARKERS if marker in (chat_template or "")), DEFAULT_TOOL_PARSER)
