"""The llguidance backend: the same constraints through guidance's Earley parser and
lexer (`--structured-outputs-backend guidance`). EBNF grammars go through its GBNF
converter; JSON is compact (", " and ": "), as with xgrammar."""

from __future__ import annotations

import json
import threading

import llguidance
import torch

from ember.loader.tokenizer import Tokenizer
from ember.sampling_params import StructuredOutputsParams
from ember.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        # consume_token on a forbidden token would leave the matcher in its error state
        return self._m.validate_tokens([token_id]) == 1 and self._m.consume_token(token_id)

    def accept_tokens(self, token_ids: list[int]) -> int:
        n = self._m.validate_tokens(token_ids)
        if n and not self._m.consume_tokens(token_ids[:n]):
            return 0
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # what llguidance.torch.fill_next_token_bitmask does, without importing torch._dynamo
        words = bitmask[row]
        assert bitmask.dtype == torch.int32 and words.is_contiguous() and words.device.type == "cpu"
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def jump_forward(self) -> str:
        return self._m.compute_ff_bytes().decode("utf-8", errors="ignore")

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class _Compiled(CompiledGrammar):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._tokenizer, self._grammar = tokenizer, grammar

    def matcher(self) -> GrammarMatcher:
        return _Matcher(llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0))


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        try:
            grammar = _grammar(params)
        except ValueError as e:
            raise ValueError(f"invalid {params.kind.replace('_', ' ')} for structured output: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(f"invalid {params.kind.replace('_', ' ')} for structured output: {messages[0]}")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return _Compiled(self.ll_tokenizer(), _grammar(params))

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, on first use (~0.3 s)
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer
