"""OpenAI's Responses API (POST /v1/responses) as a translation of chat completions.

A Responses request becomes one chat completions request (input items -> messages,
instructions -> a system message, text.format -> response_format, function tools -> chat
tools), which runs through everything the chat route has (templates, structured output,
tool calls, reasoning parsers, sampling defaults); its answer, or its stream of chunks, is turned back into a
Response object or Responses events:

    response.created, response.in_progress,
    per output item: response.output_item.added,
        reasoning:       response.reasoning_text.delta ..., response.reasoning_text.done
        a message:       response.content_part.added, response.output_text.delta ...,
                         response.output_text.done, response.content_part.done
        a function call: response.function_call_arguments.delta ...,
                         response.function_call_arguments.done
    response.output_item.done, then response.completed (or response.incomplete)

ember keeps no responses (`store` has false's meaning whatever it says): a request gives
its whole conversation, and `previous_response_id` is refused with 400.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal, Union

from pydantic import Field

from ember.server.protocol import INT64, InvalidRequest, _Strict


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without that training can honour


class ResponsesRequest(_Strict):
    """The fields of OpenAI's Responses API that ember honours. Those it cannot (hosted
    tools, background runs, stored responses, reasoning effort) are refused by name."""

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64[1])
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None  # nothing is stored, whatever it says (see the module docstring)
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = None  # vLLM's extra
    background: Literal[False] | None = None
    reasoning: None = None
    include: list[str] | None = None

    def chat_request(self) -> dict[str, Any]:
        """The chat completions request body this one runs as."""
        if self.previous_response_id is not None:
            raise InvalidRequest("ember keeps no responses, so previous_response_id cannot be resolved: send the "
                                 "whole conversation as input (store is always false here)", "previous_response_id")
        if self.include:
            raise InvalidRequest(f"include is not supported; got {self.include[0]!r:.60}", "include")
        chat: dict[str, Any] = {"messages": self.messages(), "stream": self.stream}
        for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("seed", "seed"), ("user", "user"),
                             ("parallel_tool_calls", "parallel_tool_calls")):
            if getattr(self, ours) is not None:
                chat[theirs] = getattr(self, ours)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequest("text.format of type json_schema needs a schema", "text")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}}
        if self.tools:
            chat["tools"] = [_chat_tool(t) for t in self.tools]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        return chat

    def messages(self) -> list[dict[str, Any]]:
        """Chat messages from `instructions` and `input`."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] \
            if self.instructions is not None else []
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequest("input must be a string or a non-empty list of items", "input")
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_chat_message(item))
            elif kind == "function_call":  # the model's earlier call: calls in a row form one assistant turn
                call = {"id": _text(item, "call_id"), "type": "function",
                        "function": {"name": _text(item, "name"), "arguments": _text(item, "arguments")}}
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and last.get("tool_calls") and not last.get("content"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _text(item, "call_id"),
                                 "content": _text(item, "output")})
            else:
                raise InvalidRequest(f"input items of type {kind!r:.40} are not supported: use message, "
                                     "function_call and function_call_output items", "input")
        return messages


def _text(item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"an input item of type {item.get('type', 'message')!r:.40} needs {key} as a string",
                             "input")
    return value


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _chat_message(item: dict[str, Any]) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise InvalidRequest(f"a message's role must be one of {', '.join(_ROLES)}; got {item.get('role')!r:.40}",
                             "input")
    content = item.get("content")
    if isinstance(content, list):
        texts, parts = [], []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "input_image":
                parts.append(_chat_image_part(part))
                continue
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"),
                                                                                                    str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"only text and input_image content parts are supported; got {kind!r:.40}",
                                     "input")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        # text alone joins into one string; with images, the parts as a chat message has them
        content = "".join(texts) if len(texts) == len(parts) else parts
        return {"role": role, "content": content}
    if not isinstance(content, str):
        raise InvalidRequest("a message's content must be a string or a list of text parts", "input")
    return {"role": role, "content": content}


def _chat_image_part(part: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's {"type": "input_image", "image_url": "data:...", "detail": "auto"} as
    a chat image_url part (a file_id names a stored file, which ember keeps none of)."""
    if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
        raise InvalidRequest("an input_image part needs image_url (a data: URL, or a file:// path under "
                             "--allowed-local-media-path); ember keeps no files for file_id", "input")
    unknown = sorted(set(part) - {"type", "image_url", "detail", "file_id"})
    if unknown:
        raise InvalidRequest(f"an input_image part has no field {unknown[0]!r:.40}", "input")
    image = {"url": part["image_url"]} | ({"detail": part["detail"]} if part.get("detail") is not None else {})
    return {"type": "image_url", "image_url": image}


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(f"only function tools are supported; got type {tool.get('type')!r:.40}", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                             "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


# -- the answer ------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response's object and events, fed the chat answer (or its chunks) it runs as."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.id = _id("resp")
        self.model = model
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.usage: dict[str, Any] | None = None
        self.sequence = 0

    def response(self) -> dict[str, Any]:
        r = self.request
        fmt = r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format else \
            {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": None, "incomplete_details": self.incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": self.model, "output": self.output,
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": r.temperature, "text": {"format": fmt},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [], "top_p": r.top_p,
            "truncation": "disabled", "usage": self.usage, "user": r.user, "metadata": r.metadata or {},
        }

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> None:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.usage = {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage["total_tokens"]}

    # the whole answer at once

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response object for a finished chat completion (its first choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("reasoning_content"):
            self.output.append(_reasoning_item(_id("rs"), message["reasoning_content"], "completed"))
        if message.get("content"):
            self.output.append(_message_item(_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            self.output.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"],
                                          "completed"))
        self.finish(choice.get("finish_reason"), chat["usage"])
        return self.response()

    # the answer as it comes

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        """Responses events from chat completion chunks (dicts, with usage in the last)."""
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        texts: dict[str, dict[str, Any]] = {}  # "content" / "reasoning_content" -> the item it writes
        calls: dict[int, dict[str, Any]] = {}  # chat's tool call index -> its function_call item
        finish_reason = None
        usage: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                for field in ("reasoning_content", "content"):
                    if not delta.get(field):
                        continue
                    item = texts.get(field)
                    if item is None:
                        item = texts[field] = (_reasoning_item(_id("rs"), "", "in_progress") if field ==
                                               "reasoning_content" else _message_item(_id("msg"), "", "in_progress"))
                        for event in self._open(item):
                            yield event
                    part, index = item["content"][0], self.output.index(item)
                    part["text"] += delta[field]
                    yield self._event(_TEXT_EVENTS[part["type"]] + ".delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=delta[field],
                                      **({"logprobs": []} if item["type"] == "message" else {}))
                for call in delta.get("tool_calls") or []:
                    item = calls.get(call["index"])
                    function = call.get("function") or {}
                    if item is None:
                        item = calls[call["index"]] = _call_item(call["id"], function["name"], "", "in_progress")
                        for event in self._open(item):
                            yield event
                    if function.get("arguments"):
                        item["arguments"] += function["arguments"]
                        yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.output.index(item), delta=function["arguments"])
                finish_reason = choice.get("finish_reason") or finish_reason
        for item in self.output:
            for event in self._close(item):
                yield event
        self.finish(finish_reason, usage)
        yield self._event("response.incomplete" if self.status == "incomplete" else "response.completed",
                          response=self.response())

    def _open(self, item: dict[str, Any]) -> Iterator[str]:
        self.output.append(item)
        index = len(self.output) - 1
        yield self._event("response.output_item.added", output_index=index, item=_snapshot(item))
        if item["type"] == "message":
            yield self._event("response.content_part.added", item_id=item["id"], output_index=index,
                              content_index=0, part=dict(item["content"][0]))

    def _close(self, item: dict[str, Any]) -> Iterator[str]:
        index = self.output.index(item)
        item["status"] = "completed"
        if item["type"] == "function_call":
            yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
        else:
            part = item["content"][0]
            yield self._event(_TEXT_EVENTS[part["type"]] + ".done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"],
                              **({"logprobs": []} if item["type"] == "message" else {}))
            if item["type"] == "message":
                yield self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=dict(part))
        yield self._event("response.output_item.done", output_index=index, item=_snapshot(item))


_TEXT_EVENTS = {"output_text": "response.output_text", "reasoning_text": "response.reasoning_text"}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """An item as an event carries it: a copy, so later deltas do not change what was sent."""
    copy = dict(item)
    if "content" in item:
        copy["content"] = [dict(part) for part in item["content"]] if item["status"] == "completed" else []
    return copy
