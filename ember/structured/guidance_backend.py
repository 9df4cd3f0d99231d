"""The llguidance backend: the same constraints through guidance's Earley parser and
lexer (`--structured-outputs-backend guidance`). EBNF grammars go through its GBNF
converter; JSON is compact (", " and ": "), as with xgrammar.

Rules that can never end: llguidance's jump-forward (`compute_ff_bytes`) stops by itself
(at about 25,000 bytes) and the manager cuts what it appends, so such a grammar cannot
hang the engine here; it is still refused at the boundary where the check is cheap and
faithful (`_never_ends`): JSON schemas, regexes and GBNF grammars are converted with
xgrammar (when it is installed) and checked by productivity.py. Lark grammars, which
xgrammar does not read the same way, and anything xgrammar cannot convert rely on those
length budgets. A choice always ends.
"""

from __future__ import annotations

import json
import threading

import llguidance
import torch

from ember.loader.tokenizer import Tokenizer
from ember.sampling_params import StructuredOutputsParams
from ember.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from ember.structured.productivity import check_productivity, never_ends_message

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "structural_tag":
        raise ValueError("a structural_tag needs the xgrammar backend (--structured-outputs-backend xgrammar)")
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(params.schema, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


def _never_ends(params: StructuredOutputsParams) -> str | None:
    """The boundary's message if the constraint has a rule that can never end, as far as a
    cheap, faithful check can tell (see the module docstring); None otherwise."""
    kind = params.kind
    if kind in ("choice", "structural_tag"):
        return None
    try:
        import xgrammar as xgr

        from ember.structured.xgrammar_backend import read_regex

        if kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(params.grammar)  # GBNF; Lark syntax does not parse
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(params.regex)
        else:
            grammar = xgr.Grammar.from_json_schema(params.schema, any_whitespace=False)
    except Exception:  # no xgrammar, or text it does not read: the length budgets apply
        return None
    verdict = check_productivity(str(grammar), read_regex=read_regex)
    return never_ends_message(kind, verdict) if verdict.status == "never_ends" else None


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

    @property
    def memory_size_bytes(self) -> int:
        # it holds the grammar's text only (the tokenizer is shared; each matcher builds its
        # own parser), so the text's length is its size
        return len(self._grammar)


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
        never_ends = _never_ends(params)  # before llguidance's own check: the same message as compile()
        if never_ends is not None:
            raise ValueError(never_ends)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ValueError(f"invalid {params.kind.replace('_', ' ')} for structured output: {messages[0]}")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        never_ends = _never_ends(params)  # again: the offline LLM path may reach here without validate()
        if never_ends is not None:
            raise ValueError(never_ends)
        return _Compiled(self.ll_tokenizer(), _grammar(params))

    def warm_up(self) -> None:
        self.ll_tokenizer()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once, on first use (~0.3 s)
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=sorted(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer
