"""Prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): the last n tokens of a request's
context are looked up in its earlier tokens, longest n first (prompt_lookup_max down to
prompt_lookup_min), and the tokens that followed the latest earlier occurrence are the drafts.
No model: it pays where the output repeats its input (rewriting, fixing, summarizing a text or
code in the prompt)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            # windows starting before the suffix itself: an occurrence at i is followed by i + n
            windows = sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start: start + k]
        return []
