"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's shape): a JSON schema (dict or JSON
    text), a regex, a choice among strings, a grammar (EBNF as xgrammar writes it), or
    any JSON object. Exactly one is given. Backends check the schema/regex/grammar itself."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams.json must be a JSON schema object; got {schema!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string; got {value!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings; "
                                 f"got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """json | regex | choice | grammar | json_object"""
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, n) not in (None, False))

    @property
    def schema(self) -> str:
        """The JSON schema as text (json: as given; json_object: any object)."""
        if self.json_object:
            return '{"type": "object"}'
        return self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order matters

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached under."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return kind, self.schema
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 means greedy)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0, or -1 to turn it off")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check(all(s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs, ">= 0")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               self.prompt_logprobs, ">= 0")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {allowed}; got {value!r}")
