"""The grammar backend contract: compile a constraint once, then one matcher per request
that fills its row of the step's token bitmask and follows the tokens the request gets.

Bitmask layout (shared by xgrammar and llguidance): int32 [rows, ceil(vocab / 32)];
token t is allowed in a row when bit t % 32 of word t // 32 is set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ember.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no advance) if the grammar forbids it."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> int:
        """Advance by the longest allowed prefix of `token_ids`; returns its length."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""

    @abstractmethod
    def jump_forward(self) -> str:
        """The text the grammar forces next, whatever the model would say ("" if none, or
        where the backend cannot compute it safely). May be long: the manager cuts it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    @property
    @abstractmethod
    def memory_size_bytes(self) -> int:
        """About how much memory it holds (the manager's cache is bounded by the sum)."""


class GrammarBackend(ABC):
    """Compiles StructuredOutputsParams for one tokenizer / vocabulary."""

    name: str

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError with the compiler's message if `params` cannot compile, or if its
        grammar has a rule that can never end (productivity.py). Cheap (no tokenizer work)
        and thread-safe: the boundary calls it on any thread."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile for this vocabulary; may be slow (the engine runs it on a worker thread).
        Raises ValueError as validate() does (the offline path may not have called it)."""

    def warm_up(self) -> None:
        """Build now what the first compile would (imports, the vocabulary's tables)."""


class UnavailableBackend(GrammarBackend):
    """The null backend: the engine runs, but refuses constrained requests at the boundary."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason

    def validate(self, params: StructuredOutputsParams) -> None:
        raise ValueError(f"structured output is not available: {self.reason}")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        raise ValueError(f"structured output is not available: {self.reason}")
