"""SamplingParams the tests share."""

from __future__ import annotations

import torch

from ember import SamplingParams


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    """Temperature 0: the argmax token at every step, for `max_tokens` tokens."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def chi2_pvalue(table: list[list[float]]) -> float:
    """Pearson's chi-square test of independence on a 2 x C table of counts: the p-value that the
    two rows are draws of one distribution (scipy's chi2_contingency without its continuity
    correction, which applies only to 2 x 2)."""
    counts = torch.tensor(table, dtype=torch.float64)
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = (counts.shape[0] - 1) * (counts.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))
