"""SamplingParams the tests share."""

from __future__ import annotations

from ember import SamplingParams


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    """Temperature 0: the argmax token at every step, for `max_tokens` tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
