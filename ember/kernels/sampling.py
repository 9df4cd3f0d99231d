"""Sampling at one temperature in one pass over the logits (Gumbel-max): token
argmax_i(logit_i / T + G_i), G_i = -log(-log U_i), U_i ~ U[0, 1) from Philox(seed, row * V + i),
picks token i with probability softmax(logits / T)_i. Program r walks row r in BLOCK-wide
slices, keeping the best score and its index."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, out_ptr, stride, inv_temp, seed, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * V + cols)
        score = x * inv_temp - tl.log(-tl.log(u))
        score = tl.where(mask, score, float("-inf"))
        better = score > best  # per lane: the first maximum of each lane wins ties
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, 0)
    # the smallest index among lanes holding the maximum
    winner = tl.min(tl.where(best == top, best_idx, V), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: float, seed: int, block: int = 2048) -> torch.Tensor:
    """logits [rows, V] (last dim contiguous), temperature > 0 -> sampled ids [rows] int64."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] with a contiguous last dim; got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, out, logits.stride(0), 1.0 / temperature, seed, V=vocab,
                                       BLOCK=min(block, triton.next_power_of_2(vocab)))
    return out
