"""What every tool-call parser shares: the shapes of a parse, the registry, and the stream.

A parser reads the text a model wrote so far and says what it holds (`ToolParser.scan`):
the content (text for the user) and the calls, each with its name once the name is
complete and a prefix of its arguments (JSON text). What a scan says only grows as the
text grows, so a stream sends what is new since the last scan (`ToolCallStream`), and
what a stream sends adds up to the parse of the whole text (`ToolParser.extract`).

Arguments written as JSON are given back as `json.dumps` of the parsed value; while one
is still being written, the partial value (partial-json-parser, which closes open
strings, objects and arrays but leaves out a number or literal that may still grow) is
dumped and its closing quotes and brackets dropped: what is left always begins the
finished value's text.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

ARGUMENT_KEYS = ("arguments", "parameters")  # where a JSON call object keeps its arguments


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ExtractedToolCalls:
    """The parse of a whole output: the text for the user (None if blank) and the calls."""

    content: str | None
    calls: tuple[FunctionCall, ...] = ()


@dataclass(frozen=True)
class CallScan:
    """One call as far as the text shows it."""

    name: str | None  # None until the name is complete
    arguments: str  # a prefix of the finished arguments' text (all of it once done)
    done: bool


@dataclass(frozen=True)
class Scan:
    """What a text holds so far: `content` begins the finished content, each call's
    arguments begin its finished arguments."""

    content: str
    calls: tuple[CallScan, ...] = ()


class ToolParser(ABC):
    """Reads one model family's tool-call format. Subclasses are registered by name
    (`@register_tool_parser("hermes")`) and built without arguments."""

    name: ClassVar[str] = ""
    # its markers are special tokens: the text must keep them (skip_special_tokens off)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What `text` holds; `final`: the text is complete (nothing is held back, and a call
        that does not parse, malformed or cut off by max_tokens, makes the whole text content:
        a stream may have sent its beginning as a call by then)."""

    def extract(self, text: str, max_calls: int | None = None) -> ExtractedToolCalls:
        """The calls in a whole output (at most `max_calls`) and the content around them."""
        scan = self.scan(text, final=True)
        calls = []
        for call in scan.calls[:max_calls]:
            if call.name is None:
                break
            calls.append(FunctionCall(call.name, call.arguments))
        return ExtractedToolCalls(scan.content if scan.content.strip() else None, tuple(calls))


P = TypeVar("P", bound=type[ToolParser])
TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[P], P]:
    def register(cls: P) -> P:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls

    return register


R = TypeVar("R")


def registered(registry: dict[str, R], name: str, kind: str) -> R:
    """`registry[name]`; ValueError naming the choices otherwise."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}: choose one of {', '.join(sorted(registry))}") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- streaming ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's first delta has its id and name (and empty arguments); later ones carry
    the next piece of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ToolCallStream:
    """The deltas of one growing output: feed it the whole text so far after each step."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.ids: list[str] = []  # one per call begun
        self._content = 0  # characters of content sent
        self._arguments: list[int] = []  # characters of each call's arguments sent

    def update(self, text: str, final: bool = False) -> StreamDelta:
        scan = self.parser.scan(text, final)
        content = scan.content if scan.content.strip() else ""  # blank content is never sent
        new_content = content[self._content:]
        self._content = max(self._content, len(content))
        deltas: list[ToolCallDelta] = []
        for i, call in enumerate(scan.calls[:self.max_calls]):
            if call.name is None:  # later calls wait for this one's name
                break
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self._arguments.append(0)
                deltas.append(ToolCallDelta(i, id=self.ids[i], name=call.name))
            if len(call.arguments) > self._arguments[i]:
                deltas.append(ToolCallDelta(i, arguments=call.arguments[self._arguments[i]:]))
                self._arguments[i] = len(call.arguments)
        return StreamDelta(new_content, tuple(deltas))


# -- helpers for the parsers ----------------------------------------------------------------


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (they wait
    until the next text says whether the marker follows)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def content_before(text: str, marker: str, final: bool) -> str:
    """The text before `marker` is written: all of it once final, else without a tail that
    may begin the marker."""
    return text if final else text[:len(text) - held_back(text, marker)]


def partial_json(text: str, open_strings: bool = True) -> Any:
    """The value `text` begins, its open objects and arrays closed, and its open strings
    too unless `open_strings` is False (a string is then left out until it is closed: a
    function name is only taken whole); a number or literal that may still grow is left
    out. None if `text` does not begin a JSON value."""
    import partial_json_parser  # the serve extra; only streams and unfinished text need it
    from partial_json_parser import Allow

    allow = Allow.OBJ | Allow.ARR | (Allow.STR if open_strings else 0)
    try:
        return partial_json_parser.loads(text, allow)
    except Exception:  # the library raises several types (MalformedJSON, PartialJSON, JSONDecodeError)
        return None


def arguments_text(value: Any) -> str:
    """The finished arguments' text ({} when a call gives none)."""
    return "{}" if value is None else json.dumps(value, ensure_ascii=False)


def arguments_prefix(value: Any) -> str:
    """What of a partly written value's text surely begins the finished value's: its dumps
    without the closing quotes and brackets the partial parse may have added."""
    return "" if value is None else json.dumps(value, ensure_ascii=False).rstrip('"]}')


def whole_call(obj: Any) -> CallScan | None:
    """A finished JSON call object {"name": ..., "arguments" or "parameters": ...}; None if
    it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in ARGUMENT_KEYS if key in obj), None)
    return CallScan(obj["name"], arguments_text(arguments), True)


def json_call(text: str, done: bool) -> CallScan | None:
    """One call written as a JSON object; `done`: its text is complete. None for a complete
    text that is not a call object."""
    if done:
        try:
            return whole_call(json.loads(text))
        except ValueError:
            return None
    return _partial_call(partial_json(text), partial_json(text, open_strings=False))


def _partial_call(partial: Any, whole_strings: Any) -> CallScan:
    name = whole_strings.get("name") if isinstance(whole_strings, dict) else None
    arguments = next((partial[key] for key in ARGUMENT_KEYS if key in partial), None) \
        if isinstance(partial, dict) else None
    return CallScan(name if isinstance(name, str) else None, arguments_prefix(arguments), False)


def json_array_calls(text: str, final: bool) -> list[CallScan] | None:
    """Calls written as one JSON array of call objects; None if a final text is not one."""
    try:
        items = json.loads(text)
    except ValueError:
        items = None
    if isinstance(items, list):  # complete
        calls = [whole_call(item) for item in items]
        return None if None in calls else calls  # type: ignore[return-value]
    if final:
        return None
    partial, whole_strings = partial_json(text), partial_json(text, open_strings=False)
    if not isinstance(partial, list):
        return []
    if not isinstance(whole_strings, list) or len(whole_strings) != len(partial):
        whole_strings = [None] * len(partial)
    calls = []
    for i, item in enumerate(partial):
        if i < len(partial) - 1:  # another item has begun: this one is complete
            calls.append(whole_call(item) or CallScan(None, "", True))
        else:
            calls.append(_partial_call(item, whole_strings[i]))
    return calls


def json_arguments(text: str, done: bool) -> str | None:
    """A call's arguments written as JSON on their own (not inside a call object): their text,
    or while `done` is False the prefix that surely begins it; None for a finished text that
    is not a JSON object."""
    if not done:
        return arguments_prefix(partial_json(text))
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return arguments_text(value) if isinstance(value, dict) else None


def tagged_calls(text: str, final: bool, start_tag: str, end_tag: str,
                 read: Callable[[str, bool], CallScan | None]) -> Scan:
    """Calls each in its own `start_tag` ... `end_tag` block, after any content (hermes',
    Qwen3-Coder's and GLM's formats); `read(body, done)` reads one block's text, None for a
    finished block that is not a call: a final text with one is all content, a growing one
    gives it a nameless call (which holds back the calls after it)."""
    start = text.find(start_tag)
    if start < 0:
        return Scan(content_before(text, start_tag, final))
    calls: list[CallScan] = []
    at = start
    while at >= 0:
        body = at + len(start_tag)
        end = text.find(end_tag, body)
        call = read(text[body:end if end >= 0 else len(text)], final or end >= 0)
        if call is None:
            if final:
                return Scan(text)
            call = CallScan(None, "", True)
        calls.append(call)
        at = text.find(start_tag, end + len(end_tag)) if end >= 0 else -1
    return Scan(text[:start], tuple(calls))


def marked_calls(text: str, final: bool, section: str, begin: str, sep: str, end: str,
                 name_of: Callable[[str], str | None]) -> Scan:
    """Calls in a section opened by `section`, each `begin` NAME `sep` JSON-ARGUMENTS `end`
    (DeepSeek's and Kimi's formats); `name_of` reads the name from what sits between `begin`
    and `sep` (None: not a call). A final text whose calls do not parse is all content."""
    start = text.find(section)
    if start < 0:
        return Scan(content_before(text, section, final))
    calls: list[CallScan] = []
    at = text.find(begin, start)
    while at >= 0:
        head = at + len(begin)
        split = text.find(sep, head)
        name = name_of(text[head:split]) if split >= 0 else None
        if name is None:
            if final:
                return Scan(text)
            calls.append(CallScan(None, "", False))
            break
        body = split + len(sep)
        close = text.find(end, body)
        done = final or close >= 0
        arguments = json_arguments(text[body:close if close >= 0 else len(text)], done)
        if arguments is None:
            return Scan(text)
        calls.append(CallScan(name, arguments, done))
        at = text.find(begin, close + len(end)) if close >= 0 else -1
    return Scan(text[:start], tuple(calls))


def xml_value(text: str) -> Any:
    """A parameter written as text in an XML-style call (Qwen3-Coder's, GLM's): its JSON value
    where it is JSON (a number, an object, true), else the text itself (a string)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def xml_arguments(pairs: list[tuple[str, str]], done: bool) -> str:
    """The arguments' JSON text from (name, value text) pairs: whole once `done`, else the
    prefix the finished text begins with (the pairs so far, without the closing brace)."""
    value = {name: xml_value(raw) for name, raw in pairs}
    return arguments_text(value) if done else json.dumps(value, ensure_ascii=False)[:-1]
