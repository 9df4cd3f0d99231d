"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) as a
translation of chat completions, as vLLM serves it for coding agents and Claude-style
clients.

A Messages request becomes one chat completions request (system -> a system message,
text blocks -> text, tool_use blocks -> an assistant's tool_calls, tool_result blocks ->
tool messages, tools -> function tools, tool_choice auto / any / tool / none -> auto /
required / a named function / none), which runs through everything the chat route has;
its answer, or its stream of chunks, is turned back into a Message or Anthropic's events:

    message_start, then per content block (thinking, text, tool_use):
        content_block_start, content_block_delta ... (thinking_delta, text_delta,
        input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

stop_reason: end_turn, max_tokens, stop_sequence (with the one matched) or tool_use.
Errors take Anthropic's shape, {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Union

from pydantic import Field

from ember.server import field_policy
from ember.server.protocol import INT64, InvalidRequest, _Strict

# the HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JSONFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None  # the chat template's reasoning_effort, where it has that variable
    format: JSONFormat | None = None  # structured output: JSON following the schema


class MessagesRequest(_Strict):
    """The fields of Anthropic's Messages API (and the sampling fields older clients send).
    cache_control, metadata, service_tier, speed, inference_geo, diagnostics,
    user_profile_id and workspace_id change nothing here (the prefix cache is automatic);
    thinking with a budget, a container, server tools and non-text content are refused by
    name."""

    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int = Field(ge=1, le=INT64[1])
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=INT64[1])
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    container: Any = None
    # no effect here
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def chat_request(self, max_tokens: bool = True) -> dict[str, Any]:
        """The chat completions request body this one runs as."""
        if self.thinking is not None and self.thinking.type == "enabled":
            raise InvalidRequest("thinking of type enabled is not supported: ember does not end reasoning at a "
                                 "budget_tokens (adaptive is what a reasoning model does here; its thinking comes back "
                                 "as thinking blocks with --reasoning-parser)", "thinking")
        if self.container is not None:
            raise InvalidRequest("container is not supported: ember runs no code execution", "container")
        field_policy.refused({name: getattr(self, name) for name in self.model_fields_set
                              if name in field_policy.NO_EFFECT})  # logs each the first time
        chat: dict[str, Any] = {"messages": self.chat_messages(), "stream": self.stream}
        if self.thinking is not None and self.thinking.type == "disabled":  # the templates that can switch it off
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        out = self.output_config
        if out is not None and out.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": out.format.schema_}}
        if out is not None and out.effort is not None:
            chat["reasoning_effort"] = out.effort
        if max_tokens:
            chat["max_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        if self.tools:
            chat["tools"] = [_chat_tool(t) for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise InvalidRequest("tool_choice of type tool needs the tool's name", "tool_choice")
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        return chat

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": self.system if isinstance(self.system, str) else
                             "".join(_block_text(b, "system") for b in self.system)})
        if not self.messages:
            raise InvalidRequest("messages must be a non-empty list", "messages")
        for message in self.messages:
            role, content = message.get("role"), message.get("content")
            if role not in ("user", "assistant"):
                raise InvalidRequest(f"a message's role must be user or assistant; got {role!r:.40}", "messages")
            extra = sorted(message.keys() - {"role", "content"})
            if extra:
                raise InvalidRequest(f"messages: unknown field {extra[0]!r:.40}", "messages")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif isinstance(content, list):
                messages += _user_turn(content) if role == "user" else [_assistant_turn(content)]
            else:
                raise InvalidRequest("a message's content must be a string or a list of content blocks", "messages")
        return messages


def _block_text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise InvalidRequest(f"{where}: only text blocks are supported here; got {kind!r:.40}", where)
    return block["text"]


def _user_turn(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn's blocks: its tool results as tool messages (first, as they answer the
    assistant's calls), then its text as one user message."""
    out, texts = [], []
    for block in blocks:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest("a tool_result block needs its tool_use_id", "messages")
            content = block.get("content", "")
            if isinstance(content, list):
                content = "".join(_block_text(b, "messages") for b in content)
            if not isinstance(content, str):
                raise InvalidRequest("a tool_result's content must be a string or a list of text blocks", "messages")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            texts.append(_block_text(block, "messages"))
    if texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_turn(blocks: list[Any]) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                raise InvalidRequest("a tool_use block needs its id and name", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        else:
            texts.append(_block_text(block, "messages"))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest(f"only client tools (name, description, input_schema) are supported; got a tool of "
                             f"type {tool.get('type')!r:.40}", "tools")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequest("a tool needs a name", "tools")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    max_tokens: int | None = Field(default=None, ge=1, le=INT64[1])


# -- the answer ------------------------------------------------------------------------------


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessageBuilder:
    """One Message and its events, fed the chat answer (or its chunks) it runs as."""

    def __init__(self, model: str) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"] or "{}")})
        return self.message(content, _stop(choice.get("finish_reason"), choice.get("stop_reason")),
                            _usage(chat["usage"]))

    async def events(self, chunks: AsyncIterator[dict[str, Any]], prompt_tokens: int) -> AsyncIterator[str]:
        """Anthropic's events from chat completion chunks (dicts, with usage in the last)."""
        yield _event("message_start", message=self.message([], (None, None), {
            "input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0}))
        index = -1
        open_kind: str | tuple | None = None  # "thinking", "text", or ("tool_use", the chat call's index)
        finish_reason = stop_reason = None
        usage: dict[str, Any] | None = None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                pieces: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []  # (kind, block start, delta)
                if delta.get("reasoning_content"):
                    pieces.append(("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
                if delta.get("content"):
                    pieces.append(("text", {"type": "text", "text": ""},
                                   {"type": "text_delta", "text": delta["content"]}))
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    start = {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}}
                    pieces.append((("tool_use", call["index"]), start,
                                   {"type": "input_json_delta", "partial_json": function.get("arguments") or ""}))
                for kind, start, piece in pieces:
                    if kind != open_kind:
                        if open_kind is not None:
                            yield _event("content_block_stop", index=index)
                        index, open_kind = index + 1, kind
                        yield _event("content_block_start", index=index, content_block=start)
                    if piece.get("text") or piece.get("thinking") or piece.get("partial_json"):
                        yield _event("content_block_delta", index=index, delta=piece)
                finish_reason = choice.get("finish_reason") or finish_reason
                stop_reason = choice.get("stop_reason") if choice.get("stop_reason") is not None else stop_reason
        if open_kind is not None:
            yield _event("content_block_stop", index=index)
        reason, sequence = _stop(finish_reason, stop_reason)
        output_tokens = usage["completion_tokens"] if usage else 0
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": output_tokens})
        yield _event("message_stop")


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"
