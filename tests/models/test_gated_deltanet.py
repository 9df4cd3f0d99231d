"""models/gated_deltanet.py: the chunked gated delta rule (a prefill's matrix form) equals the
token-by-token recurrence, from a nonzero state, across chunk boundaries and a short last chunk."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.models.gated_deltanet import delta_rule_chunked, delta_rule_step


def _inputs(n: int, heads: int = 3, dk: int = 8, dv: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1)
    v = torch.randn(n, heads, dv, generator=gen)
    # decays from 0.9999 to about exp(-8) a token, as softplus and A in 1..16 give
    g = -torch.rand(n, heads, generator=gen) * torch.tensor([1e-4, 0.5, 8.0])
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return state, q, k, v, g, beta


@pytest.mark.parametrize("n, chunk", [(1, 64), (7, 64), (64, 64), (150, 64), (40, 16)])
def test_chunked_equals_the_recurrence(n, chunk):
    state, q, k, v, g, beta = _inputs(n)
    stepped = state.clone()[None]
    want = torch.cat([delta_rule_step(stepped, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
                      for t in range(n)])
    chunked = state.clone()
    got = delta_rule_chunked(chunked, q, k, v, g, beta, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked, stepped[0], rtol=1e-5, atol=1e-5)
