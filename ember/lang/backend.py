"""What a program's state needs from a backend (in-process: local.py; over HTTP:
runtime_endpoint.py), in token space: text becomes tokens once, the model's own output ids
are kept, and every call's prompt is the state's tokens so far, so the prefix cache finds all
of them. Roles come from the model's chat template, rendered and split."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONTENT = "ember_lang_role_content_5f3c"  # a message's content while its role's text is read off the template


@dataclass
class GenResult:
    """One gen's output: its text, the model's token ids, and SGLang's meta_info fields."""

    text: str
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    output_token_logprobs: list[tuple[float, int, Any]] | None = None
    output_top_logprobs: list[list[tuple[float, int, Any]]] | None = None

    def meta_info(self) -> dict[str, Any]:
        meta = {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.output_ids),
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason}
        if self.output_token_logprobs is not None:
            meta["output_token_logprobs"] = self.output_token_logprobs
        if self.output_top_logprobs is not None:
            meta["output_top_logprobs"] = self.output_top_logprobs
        return meta


@dataclass
class ScoreResult:
    """select's one engine call: each choice's own tokens' logprobs (conditional on the
    prefix, and alone where asked; the first alone is None), and each request's counts."""

    logprobs: list[list[float]]
    unconditional: list[list[float | None]] | None
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


class Backend(ABC):
    """The model behind a program: tokenizer and chat template, generate, score choices."""

    def __init__(self) -> None:
        self._roles: dict[tuple[str, tuple[str, ...]], tuple[str, str]] = {}
        self._lock = threading.Lock()
        self.num_engine_calls = 0  # generate and score calls sent (a select's is one)
        self.num_engine_requests = 0  # the engine requests of those calls (a select's: one a choice)

    # -- the tokenizer and the chat template ------------------------------------------------

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    @abstractmethod
    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat template's text of these messages (no generation prompt)."""

    def role_affixes(self, role: str, previous: tuple[str, ...]) -> tuple[str, str]:
        """The text the chat template writes before and after a `role` message's content,
        after messages of the `previous` roles: the template rendered with a marker content,
        less the history's own rendering, split at the marker."""
        key = (role, previous)
        with self._lock:
            if key in self._roles:
                return self._roles[key]
        history = [{"role": r, "content": "x"} for r in previous]
        full = self.render(history + [{"role": role, "content": CONTENT}])
        base = self.render(history) if history else ""
        if not full.startswith(base) or full.count(CONTENT) != 1:
            raise ValueError(f"the chat template does not write a {role!r} message after {list(previous)} as text "
                             "added to the conversation's: ember.lang cannot read its role markers")
        prefix, suffix = full[len(base):].split(CONTENT)
        with self._lock:
            self._roles[key] = prefix, suffix
        return prefix, suffix

    def encode_first(self, text: str) -> list[int]:
        """A state's first text: with the tokenizer's special tokens (BOS), unless the text
        already writes them (a chat template's)."""
        ids = self.encode(text, True)
        plain = self.encode(text, False)
        extra = len(ids) - len(plain)
        if extra > 0 and ids[extra:] == plain and plain[:extra] == ids[:extra]:
            return plain
        return ids

    # -- the model -------------------------------------------------------------------------

    @abstractmethod
    def generate(self, input_ids: list[int], sampling: dict[str, Any], logprobs: dict[str, Any],
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        """One completion of `input_ids`; `sampling` in SGLang's names; `on_text(text so far)`
        as it grows, where given."""

    @abstractmethod
    def score(self, prefix: list[int], choices: list[list[int]], unconditional: bool) -> ScoreResult:
        """Every choice's tokens after `prefix` scored in one engine call (and alone, where
        `unconditional`)."""

    def flush_cache(self) -> bool:
        return False

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Release what the backend started (threads, connections)."""

    def count_call(self, num_requests: int = 1) -> None:
        with self._lock:
            self.num_engine_calls += 1
            self.num_engine_requests += num_requests


def kept_tokens(output_ids: list[int], text: str, decode: Callable[[list[int]], str],
                encode: Callable[[str], list[int]]) -> list[int]:
    """The tokens a state keeps for a gen's `text`: the model's own ids as far as they spell
    the text, `decode` spelling them as the gen's text was (special tokens skipped or not),
    so a special token the model wrote inside the text stays; then the rest of the text
    tokenized. Trailing ids that spell nothing (the EOS that ended it) and a stop string's
    tokens are dropped."""
    for k in range(len(output_ids), -1, -1):
        spelled = decode(output_ids[:k]) if k else ""
        if text.startswith(spelled):
            while k and decode(output_ids[:k - 1]) == spelled:
                k -= 1
            rest = text[len(spelled):]
            return output_ids[:k] + (encode(rest) if rest else [])
    raise AssertionError("unreachable: the empty prefix spells every text")
