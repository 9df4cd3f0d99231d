"""The one-pass Gumbel-max sampling kernel draws from softmax(logits / T). CPU: Triton's
interpreter; `-m gpu`: CUDA at the Qwen3 vocabulary size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ember.kernels.sampling import _exp2_draw, gumbel_argmax  # noqa: E402

L = [0.5, 2.0, -1.0, 3.0, 0.0, 1.5, -2.0, 2.5, 0.1, -0.5, 1.0, 2.9]


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def test_gumbel_argmax_follows_the_distribution(device):
    rows = 400 if device == "cpu" else 20000  # the interpreter runs one row at a time
    logits = torch.tensor([L] * rows, device=device)
    # one slice per row: the interpreter runs each program in Python (slices have their own test below)
    ids = gumbel_argmax(logits, 0.7, seed=5, block=16)
    counts = torch.zeros(len(L)).index_add_(0, ids.cpu(), torch.ones(rows))
    expected = (torch.tensor(L) / 0.7).softmax(-1)
    # Philox draws are fixed by the seed: this passes or fails the same way every run
    assert (counts / rows - expected).abs().max() < (0.06 if device == "cpu" else 0.01)
    few = logits[:16]
    assert torch.equal(gumbel_argmax(few, 0.7, seed=5, block=16), ids[:16])  # the same seed, the same draws
    assert not torch.equal(gumbel_argmax(few, 0.7, seed=6, block=16), ids[:16])


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def test_the_draw_does_not_depend_on_the_slicing(device):
    """One request's row is cut into slices that SMs share, then the best slice wins: the
    same token as one program walking the whole row, for any slice count, ties included."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1000, generator=g)
    logits[1] = 0.0  # every token ties before the noise
    logits[2, 700:] = float("-inf")  # whole slices masked out (a grammar's bitmask)
    logits = logits.to(device)
    whole = gumbel_argmax(logits, 0.9, seed=11, block=64, slices=1)
    for slices in (2, 3, 7, 16, 100):
        assert torch.equal(gumbel_argmax(logits, 0.9, seed=11, block=64, slices=slices), whole), slices
    assert torch.equal(gumbel_argmax(logits[:1], 0.9, seed=11, block=64), whole[:1])  # default: 16 slices here
    assert whole[2] < 700


@pytest.mark.gpu
def test_gumbel_argmax_at_a_real_vocabulary():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda", generator=g)
    logits[:, 12345] += 40.0  # a near-certain token
    assert torch.all(gumbel_argmax(logits, 1.0, seed=1) == 12345)


@triton.jit
def _draw_kernel(u_ptr, out_ptr, N: tl.constexpr, FAST: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _exp2_draw(tl.load(u_ptr + i), FAST))


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def test_exponential_draw_is_accurate_near_one(device):
    """-log2(u) to float32 precision over all of (0, 1), near 1 included (there the draw is
    tiny and becomes a large Gumbel value: an approximate log would bias unlikely tokens).
    On CUDA with the hardware's approximate log2, as the kernel runs there."""
    near_one = 1.0 - torch.arange(1, 257, dtype=torch.float64) * 2.0 ** -24  # 1 - k ulp(1)/2
    u = torch.cat([near_one, torch.linspace(1e-6, 0.999, 768, dtype=torch.float64)]).float()
    out = torch.empty_like(u, device=device)
    _draw_kernel[(1,)](u.to(device), out, N=1024, FAST=device == "cuda")
    want = -torch.log2(u.double())
    # the approximate log2 errs by <= 2^-22.6 absolute: <= 7e-6 relative where the series stops
    # (-log2(1 - 1/64) = 0.0227); without the series it is off by up to 100 % next to 1
    assert ((out.cpu().double() - want) / want).abs().max() < 1e-5
