"""The xgrammar backend (the default): JSON schema, regex, choice and EBNF grammars
compiled to a token-level automaton with a precomputed mask cache.

Every grammar goes through the productivity check (productivity.py) before it is served:
one with a rule that can never end is refused (xgrammar's jump-forward would run forever
on it), one the check cannot read is served with jump-forward off."""

from __future__ import annotations

import json
import logging
import threading

import torch
import xgrammar as xgr

from ember.loader.tokenizer import Tokenizer
from ember.sampling_params import StructuredOutputsParams
from ember.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher
from ember.structured.productivity import Productivity, check_productivity, never_ends_message

logger = logging.getLogger(__name__)

# xgrammar's own cache of compiled grammars (and per-rule masks) sits under the manager's
# byte-bounded cache and mostly holds the same grammars: bounded so it cannot grow forever
COMPILER_CACHE_BYTES = 64 << 20


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # a JSON string literal is also an EBNF string literal (same escapes)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The tokenizer-free grammar: cheap, and raises on a bad schema / regex / EBNF."""
    kind = params.kind
    if kind in ("json", "json_object"):
        # compact JSON (", " and ": "): a small model given free whitespace may emit
        # newlines forever, and a fixed layout lets jump-forward fill in keys
        return xgr.Grammar.from_json_schema(params.schema, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(_choice_ebnf(params.choice))
    if kind == "structural_tag":
        return _structural_tag(json.loads(params.structural_tag))
    return xgr.Grammar.from_ebnf(params.grammar)


def _structural_tag(tag: dict) -> xgr.Grammar:
    """vLLM's two shapes: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or
    {"format": ...} (xgrammar's own structural tag)."""
    if "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s["schema"], end=s["end"]) for s in tag["structures"]]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(tag)


def _checked_grammar(params: StructuredOutputsParams) -> tuple[xgr.Grammar, Productivity]:
    """The grammar and whether it can always end; ValueError (the boundary's message) for a
    schema / regex / EBNF that does not parse or has a rule that can never end."""
    try:
        grammar = _grammar(params)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError
        raise ValueError(f"invalid {params.kind.replace('_', ' ')} for structured output: "
                         f"{_compiler_message(e)}") from None
    verdict = check_productivity(str(grammar), read_regex=read_regex)
    if verdict.status == "never_ends":
        raise ValueError(never_ends_message(params.kind, verdict))
    return grammar, verdict


def read_regex(pattern: str) -> str:
    """xgrammar's normalized EBNF of a regex: how productivity.py reads `Regex("...")`."""
    return str(xgr.Grammar.from_regex(pattern))


def _compiler_message(e: Exception) -> str:
    # "[00:44:10] /project/cpp/regex_converter.cc:94: Regex parsing error ..." -> the message
    text = str(e).strip()
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else text


class _Matcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher, jump_forward: bool) -> None:
        self._m = matcher
        self._jump_forward = jump_forward  # False: the grammar may not end (find_jump_forward_string could hang)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def accept_tokens(self, token_ids: list[int]) -> int:
        for i, t in enumerate(token_ids):
            if not self._m.accept_token(t):
                return i
        return len(token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def jump_forward(self) -> str:
        return self._m.find_jump_forward_string() if self._jump_forward else ""

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)


class _Compiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar, jump_forward: bool) -> None:
        self._compiled = compiled
        self.jump_forward = jump_forward

    def matcher(self) -> GrammarMatcher:
        return _Matcher(xgr.GrammarMatcher(self._compiled), self.jump_forward)

    @property
    def memory_size_bytes(self) -> int:
        return self._compiled.memory_size_bytes


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._spelled: frozenset[int] | None = None  # the bytes some token's text holds
        self._lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        _checked_grammar(params)
        if params.choice:
            self._check_spellable(params.choice)

    def _check_spellable(self, choices: tuple[str, ...]) -> None:
        """A choice holding a byte that no token holds (SmolLM2's vocabulary has none of
        0xF1, 0xF2 and a few control bytes) is a dead end the grammar would only meet mid-way
        through the output: refused here instead."""
        if self._spelled is None:
            self.compiler()
        for i, choice in enumerate(choices):
            missing = set(choice.encode("utf-8", "surrogatepass")) - self._spelled
            if missing:
                raise ValueError(f"choice {i} ({choice[:40]!r}) holds bytes no token of the model's vocabulary "
                                 f"has ({', '.join(f'0x{b:02X}' for b in sorted(missing))}), so it can never be "
                                 "generated: remove those characters")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Checked again here: the offline LLM path may reach it without validate()."""
        grammar, verdict = _checked_grammar(params)
        if verdict.status == "unknown":
            logger.warning("the grammar of a %s constraint could not be checked for rules that never end "
                           "(%s): served with jump-forward off", params.kind.replace("_", " "), verdict.reason)
        try:
            compiled = self.compiler().compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"invalid {params.kind.replace('_', ' ')} for structured output: "
                             f"{_compiler_message(e)}") from None
        return _Compiled(compiled, jump_forward=verdict.status == "ends")

    def warm_up(self) -> None:
        self.compiler()

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:  # built once, on first use (~30 ms)
            if self._compiler is None:
                info = tokenizer_info(self.tokenizer, self.vocab_size)
                self._spelled = frozenset(b for token in info.decoded_vocab for b in token)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of ember's tokenizer: each id's byte-level token text, special tokens
    as "" (so no grammar matches them as text), ids past the tokenizer up to the model's
    logits width as "" too (never allowed)."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size or max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has {len(vocab)} tokens but the model's logits are {vocab_size} wide")
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        encoded[i] = token
    for i in tokenizer.all_special_ids:
        encoded[i] = ""
    return xgr.TokenizerInfo(encoded, _vocab_type(tokenizer), vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))


def _vocab_type(tokenizer: Tokenizer) -> xgr.VocabType:
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW
