"""The batch-invariant matmul of deterministic mode (kernels/matmul.py) against F.linear in
float32, and its point: a row's bits do not depend on the call's row count. CPU: Triton's
interpreter, on each config alone; `-m gpu`: CUDA, where every config of CONFIGS must also
give the same bits as every other (the auto choice switches config by row count)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from float_order import same_bits  # noqa: E402

from ember.kernels.matmul import CONFIGS, config_for, invariant_matmul  # noqa: E402

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _data(m, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (7, 130, 64), (70, 33, 200)])
def test_matches_linear(device, dtype, m, n, k):
    x, w, b = _data(m, n, k, dtype, device)
    for bias in (None, b):
        got = invariant_matmul(x, w, bias)
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.cpu(), want.cpu(), **tol)
    assert invariant_matmul(x[:0], w).shape == (0, n)
    with pytest.raises(ValueError, match="does not fit weight"):
        invariant_matmul(x, w[:, :-1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [c[1:] for c in CONFIGS], ids=lambda c: "x".join(map(str, c)))
def test_a_row_gets_the_same_bits_at_any_row_count(device, config):
    """Rows of calls of 1, 7, 16, 33 and 65 rows, at any offset, against one call of 130."""
    x, w, b = _data(130, 96, 192, torch.bfloat16, device, seed=1)
    whole = invariant_matmul(x, w, b, config=config)
    for size in (1, 7, 16, 33, 65):
        for start in (0, 5, 130 - size):
            same_bits(invariant_matmul(x[start:start + size], w, b, config=config), whole[start:start + size])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_every_config_gives_the_same_bits_on_the_gpu(n, k):
    """Llama-8B's layer shapes (q|k|v, o, gate|up, down, the head): every config of CONFIGS,
    and the auto choice at 1 .. 300 rows, equal to one config's call over all rows."""
    x, w, b = _data(300, n, k, torch.bfloat16, "cuda", seed=2)
    want = invariant_matmul(x, w, config=CONFIGS[-1][1:])
    for config in [c[1:] for c in CONFIGS]:
        assert torch.equal(invariant_matmul(x, w, config=config), want), config
    for rows in (1, 3, 64, 65, 300):
        assert torch.equal(invariant_matmul(x[:rows], w), want[:rows]), (rows, config_for(rows))
