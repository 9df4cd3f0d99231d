"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_SCHEMA_DEPTH = 64  # nested lists / objects in a JSON schema: its compile time grows with the depth


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in `value` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            stack.extend((x, depth + 1) for x in item)
    return deepest


KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # a constraint's one field


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's shape): a JSON schema (dict or JSON
    text), a regex, a choice among strings, a grammar (EBNF as xgrammar writes it), any
    JSON object, or a structural tag. Exactly one is given. Backends check the schema/regex/grammar itself.

    `reasoning_end` (a reasoning model's answer): the token ids that end its reasoning (the
    tokenizer's encoding of "</think>"). The output then begins inside the reasoning: every
    token is free until the output ends with these ids, and the constraint applies to the
    tokens after them. Give it only where the output does begin in reasoning (not where the
    prompt already closed it, e.g. a template's empty <think></think>): an output that never
    writes the end sequence is never constrained."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's structural tag (JSON text): free text until a trigger, then the tag's schema (xgrammar only)
    structural_tag: str | None = None
    reasoning_end: list[int] | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if self.structural_tag is not None:
            try:
                tag = json.loads(self.structural_tag) if isinstance(self.structural_tag, str) else None
            except (json.JSONDecodeError, RecursionError):
                tag = None
            if not isinstance(tag, dict) or _depth(tag) > MAX_SCHEMA_DEPTH:
                raise ValueError("StructuredOutputsParams.structural_tag must be a JSON object's text, as vLLM's "
                                 "response_format of type structural_tag")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
                except RecursionError:
                    raise ValueError(f"StructuredOutputsParams.json nests more than {MAX_SCHEMA_DEPTH} levels") \
                        from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams.json must be a JSON schema object; got {schema!r:.80}")
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"StructuredOutputsParams.json nests more than {MAX_SCHEMA_DEPTH} levels")
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
        if self.reasoning_end is not None:
            if isinstance(self.reasoning_end, (str, bytes)) or not self.reasoning_end or \
                    not all(_is_int(t) and t >= 0 for t in self.reasoning_end):
                raise ValueError("StructuredOutputsParams.reasoning_end must be a non-empty list of token ids "
                                 f"(integers >= 0); got {self.reasoning_end!r:.80}")
            object.__setattr__(self, "reasoning_end", tuple(self.reasoning_end))

    @property
    def kind(self) -> str:
        """json | regex | choice | grammar | json_object | structural_tag"""
        return next(n for n in KINDS if getattr(self, n) not in (None, False))

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


SAMPLING_EPS = 1e-5  # a temperature below this is greedy (as vLLM): 1 / 1e-40 overflows float32 logits
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit generator takes; the generator gets seed mod 2**64


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the request's own generator: the same seed in the same batch gives the same tokens (with
    # speculative decoding too, though not the tokens it gives without: spec_decode/__init__.py)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len; 0: score the prompt only (prompt_logprobs)
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # prompt logprobs from this prompt position on (SGLang's logprob_start_len): the positions
    # before it get None and may come from the prefix cache
    prompt_logprobs_start: int = 0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generated: their tokens, with a leading space or not
    bad_words_token_ids: list[list[int]] | None = None  # bad_words tokenized (by the input processor, if not given)
    # reasoning of at most this many output tokens: then thinking_end_token_ids ("</think>") are forced
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        """Every field's type and range: a value that passes can become a tensor or an
        integer anywhere in the engine without overflow, NaN or a type error."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a string or a list of non-empty strings")
        self.stop = list(self.stop)
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0
                                                                      for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids (integers >= 0)")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k, ">= 0, or -1 to turn it off")
        if self.top_k == -1:
            self.top_k = 0
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               ">= 0 (0 means greedy)")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "> 0")
        _check(self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               "seed", self.seed, "an integer in [-2**63, 2**64 - 1] (a 64-bit seed)")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0), "max_tokens",
               self.max_tokens, "an integer >= 0 (0 scores the prompt only)")
        _check(self.max_tokens != 0 or self.n == 1, "n", self.n, "1 with max_tokens=0 (prompt scoring only)")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0), name, value, "None or an integer >= 0")
        _check(_is_int(self.prompt_logprobs_start) and self.prompt_logprobs_start >= 0, "prompt_logprobs_start",
               self.prompt_logprobs_start, "an integer >= 0 (a prompt position)")
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_real(b) for t, b in self.logit_bias.items())), "logit_bias",
            self.logit_bias, "a dict of token id (integer >= 0) -> finite bias")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        _check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, (list, tuple))
                                                  and self.allowed_token_ids
                                                  and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids (integers >= 0)")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        _check(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                 for w in self.bad_words),
               "bad_words", self.bad_words, "a list of words (non-blank strings)")
        self.bad_words = list(self.bad_words)
        _check(self.thinking_token_budget is None or (_is_int(self.thinking_token_budget)
                                                      and self.thinking_token_budget >= 0),
               "thinking_token_budget", self.thinking_token_budget, "None or an integer >= 0")
        _check(self.thinking_end_token_ids is None or (isinstance(self.thinking_end_token_ids, (list, tuple))
                                                       and self.thinking_end_token_ids
                                                       and all(_is_int(t) and t >= 0 for t in self.thinking_end_token_ids)),
               "thinking_end_token_ids", self.thinking_end_token_ids, "None or a non-empty list of token ids")
        _check(self.thinking_token_budget is None or self.thinking_end_token_ids is not None, "thinking_end_token_ids",
               self.thinking_end_token_ids, "given with thinking_token_budget (the tokens that end the reasoning)")
        _check(self.bad_words_token_ids is None or (isinstance(self.bad_words_token_ids, (list, tuple)) and all(
            isinstance(ids, (list, tuple)) and ids and all(_is_int(t) and t >= 0 for t in ids)
            for ids in self.bad_words_token_ids)), "bad_words_token_ids", self.bad_words_token_ids,
            "None or a list of non-empty lists of token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or a finite float (not a bool, NaN or infinity)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {allowed}; got {value!r:.200}")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus transformers' early_stopping (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in 1..10 (2 x beam_width log-probabilities a step); got "
                             f"{self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search here is transformers' deterministic one (do_sample=False): leave "
                             "temperature 0")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\"; got {self.early_stopping!r}")

    def step_params(self) -> SamplingParams:
        """How each beam samples (engine/beam_groups.py): greedy, with the top 2k log-probabilities;
        the search decides which beams go on and where they end."""
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, logprobs=2 * self.beam_width,
                              ignore_eos=True)
