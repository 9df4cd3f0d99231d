"""What the engine core asks for drafts after each step: `propose_for(requests)`, one list of
drafts a request. A proposer that reads only a request's own tokens implements `propose`; the
draft_model method's proposer is the model runner itself (it runs the draft model on the device)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from ember.request import Request


class Drafts(Protocol):
    def propose_for(self, requests: list[Request]) -> list[list[int]]:
        """Each request's drafts for its next step (possibly none)."""


class Proposer(ABC):
    """Drafts from a request's token ids alone."""

    @abstractmethod
    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k drafts (default: the configured number) to follow `token_ids`."""

    def propose_for(self, requests: list[Request]) -> list[list[int]]:
        return [self.propose(r.all_token_ids) for r in requests]
