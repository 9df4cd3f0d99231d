"""Prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): the last n tokens of a request's
context are looked up in its earlier tokens, longest n first (prompt_lookup_max down to
prompt_lookup_min), and the tokens that followed the latest earlier occurrence are the drafts.
No model: it pays where the output repeats its input (rewriting, fixing, summarizing a text or
code in the prompt)."""

from __future__ import annotations

import numpy as np

from ember.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k (default: num_speculative_tokens) drafts to follow `token_ids`; [] when no
        suffix of at least lookup_min tokens occurred before."""
        k = self.k if k is None else k
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        longest = min(self.lookup_max, n_tokens - 1)
        # alive[e]: tokens ending at e (before the last one) match the context's suffix of the
        # length reached so far; a longer match holds every shorter one, so the longest length
        # with a match is found by growing it, and its latest end gives the drafts
        alive = tokens[:-1] == tokens[-1]
        end = -1
        for n in range(1, longest + 1):
            if n > 1:
                alive[:n - 1] = False
                alive[n - 1:] &= tokens[:n_tokens - n] == tokens[n_tokens - n]
            hits = np.flatnonzero(alive)
            if not hits.size:
                break
            if n >= self.lookup_min:
                end = int(hits[-1])
        return token_ids[end + 1: end + 1 + k] if end >= 0 else []
