"""The one-pass Gumbel-max sampling kernel draws from softmax(logits / T). CPU: Triton's
interpreter; `-m gpu`: CUDA at the Qwen3 vocabulary size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels.sampling import gumbel_argmax  # noqa: E402

L = [0.5, 2.0, -1.0, 3.0, 0.0, 1.5, -2.0, 2.5, 0.1, -0.5, 1.0, 2.9]


@pytest.mark.parametrize("device", [pytest.param("cpu", id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def test_gumbel_argmax_follows_the_distribution(device):
    rows = 400 if device == "cpu" else 20000  # the interpreter runs one row at a time
    logits = torch.tensor([L] * rows, device=device)
    ids = gumbel_argmax(logits, 0.7, seed=5, block=8)  # two slices per row, the second one masked
    counts = torch.zeros(len(L)).index_add_(0, ids.cpu(), torch.ones(rows))
    expected = (torch.tensor(L) / 0.7).softmax(-1)
    # Philox draws are fixed by the seed: this passes or fails the same way every run
    assert (counts / rows - expected).abs().max() < (0.06 if device == "cpu" else 0.01)
    few = logits[:16]
    assert torch.equal(gumbel_argmax(few, 0.7, seed=5, block=8), ids[:16])  # the same seed, the same draws
    assert not torch.equal(gumbel_argmax(few, 0.7, seed=6, block=8), ids[:16])


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
