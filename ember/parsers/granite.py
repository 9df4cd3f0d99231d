"""granite: <|tool_call|> and then a JSON array of calls (IBM Granite 3.x; its chat template
tells the model to "respond only with <|tool_call|> followed by a JSON list of tools used");
Granite 3.1 may write the marker as plain <tool_call>, as vLLM's parser also takes:

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]

(Granite 4 writes hermes' <tool_call>{...}</tool_call> blocks: the hermes parser.)
"""

from __future__ import annotations

from ember.parsers.base import register_tool_parser
from ember.parsers.mistral import MarkedArrayToolParser


@register_tool_parser("granite")
class GraniteToolParser(MarkedArrayToolParser):
    keeps_special_tokens = True  # <|tool_call|> is a special token
    markers = ("<|tool_call|>", "<tool_call>")
