"""Speculative sampling (sampler.verify_drafts): whatever the drafter's q, the token a drafted
row keeps is distributed as the target's p. Exactly, by enumerating the uniforms on a grid
that the probabilities (multiples of 1/8) divide; and empirically through the Sampler, whose
`draft` draws the drafts and q and whose rows verify them."""

from fractions import Fraction

import pytest
import torch

from ember.runner.sampler import Sampler, SamplingRow, verify_drafts
from ember.sampling_params import SamplingParams

EIGHTHS = [  # (p, q) in eighths over 6 tokens
    ([4, 2, 1, 1, 0, 0], [1, 3, 0, 2, 2, 0]),  # overlapping supports: residual (3, 0, 1, 0, 0, 0) / 4
    ([2, 2, 2, 1, 1, 0], [2, 2, 2, 1, 1, 0]),  # q = p: every draft kept
    ([4, 2, 1, 1, 0, 0], [0, 8, 0, 0, 0, 0]),  # a point mass: kept with p(1), else p without token 1
]
GRID = 24  # each ratio p(d) / q(d) < 1 and each residual probability above is a multiple of 1/24
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # one code path: the same numbers on both


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p8, q8", EIGHTHS)
def test_the_kept_token_is_distributed_exactly_as_p(p8, q8, device):
    """Every draft d (weight q(d)) against every (u, v) at the midpoints of a 24 x 24 grid: the
    weighted counts of the tokens kept are p, as fractions. p and q come unnormalized (x3, x0.5)."""
    mids = (torch.arange(GRID, dtype=torch.float32) + 0.5) / GRID
    drafts = [d for d in range(6) if q8[d]]
    d, u, v = (t.reshape(-1) for t in torch.meshgrid(torch.tensor(drafts, dtype=torch.float32), mids, mids,
                                                       indexing="ij"))
    d = d.long()
    n = d.shape[0]
    p = torch.tensor(p8, dtype=torch.float32).repeat(n, 1) * 3
    q = torch.tensor(q8, dtype=torch.float32).repeat(n, 1) * 0.5
    tokens = verify_drafts(*(t.to(device) for t in (p, q, d, u, v))).cpu()
    counts = [Fraction(0)] * 6
    for draft, token in zip(d.tolist(), tokens.tolist()):
        counts[token] += Fraction(q8[draft], 8) / GRID**2
    assert counts == [Fraction(x, 8) for x in p8]
    # the draft is kept exactly where u * q(d) < p(d), and a replacement is never the draft
    kept = u * torch.tensor(q8)[d] < torch.tensor(p8)[d]
    assert torch.equal(tokens == d, kept)


def _log(probs: list[float]) -> list[float]:
    return [torch.tensor(x).log().item() if x > 0 else float("-inf") for x in probs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grammar", [False, True])
def test_drafts_drawn_and_verified_by_the_sampler_keep_p(grammar, device):
    """100,000 seeded rows: Sampler.draft draws each draft from q (temperature 1 over log q),
    the sampler's drafted rows verify them against p. The kept tokens' frequencies are p's
    within 5 standard errors (0.008 at most), zero where p is zero, and the share kept is
    sum(min(p, q)). With a grammar that allows tokens 0-2 only (drafts it refuses never
    reach a row), q is masked like p: unmasked, every draft here would be kept."""
    n = 100_000
    params = SamplingParams(temperature=1.0)
    if grammar:
        p, q = [0.5, 0.3, 0.2, 0, 0, 0], [1 / 6] * 6
        allowed = torch.tensor([0b111], dtype=torch.int32)
    else:
        p, q = [0.5, 0.25, 0.125, 0.125, 0, 0], [0.125, 0.375, 0, 0.25, 0.25, 0]
        allowed = None
    sampler = Sampler(seed=7)
    drafts, q_rows = sampler.draft(torch.tensor([_log(q)], device=device).expand(n, 6),
                                   [SamplingRow(params, None, [1], [], frozenset())] * n)
    if grammar:  # what the engine does: a draft the grammar refuses ends the run before its row
        inside = drafts < 3
        drafts, q_rows = drafts[inside], [r for r, ok in zip(q_rows, inside.tolist()) if ok]
    rows = [SamplingRow(params, None, [1], [], frozenset(), allowed, draft=(d, r))
            for d, r in zip(drafts.tolist(), q_rows)]
    tokens = sampler(torch.tensor([_log(p)], device=device).expand(len(rows), 6), rows).tokens.cpu()
    drafts = drafts.cpu()
    m = len(rows)
    freq = torch.bincount(tokens, minlength=6).double() / m
    target = torch.tensor(p, dtype=torch.float64)
    bound = 5 * (target * (1 - target) / m).sqrt()
    assert ((freq - target).abs() <= bound).all() and freq[target == 0].eq(0).all(), (freq, target)
    masked_q = torch.tensor(q[:3] + [0] * 3 if grammar else q, dtype=torch.float64)
    overlap = torch.minimum(target, masked_q / masked_q.sum()).sum()
    kept = (tokens == drafts).double().mean()
    assert abs(kept - overlap) <= 5 * (overlap * (1 - overlap) / m).sqrt(), (kept, overlap)
