"""Sampling at one temperature in one pass over the logits (Gumbel-max): token
argmax_i(logit_i / T + G_i), G_i = -log(-log U_i), U_i ~ U[0, 1) from Philox(seed, row * V + i),
picks token i with probability softmax(logits / T)_i.

Program (r, s) walks slice s of row r in BLOCK-wide tiles, keeping the best score and its
index. Rows are cut into slices so that rows x slices programs fill the GPU (one request:
75 slices of its 151936 logits); a second kernel then picks each row's best slice. Ties go to the
smallest index either way, so the draw does not depend on the slicing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TARGET_PROGRAMS = 1056  # ~8 an SM on an H200: the Philox draws and logs keep each one busy
MAX_SLICES = 128


# Every argument that changes from step to step (the seed, the slicing, which follows the
# batch size) is a plain runtime value: a new constexpr or specialization would compile a
# new kernel in the middle of serving (seconds each; the first engine of a device call ran
# several times slower from that).
@triton.jit(do_not_specialize=["seed", "slice_len", "slices"])
def _gumbel_argmax_kernel(logits_ptr, score_ptr, idx_ptr, stride, inv_temp, seed, slice_len, slices,
                          V: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(s * slice_len, tl.minimum((s + 1) * slice_len, V), BLOCK):
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
    if DIRECT:  # one slice a row: the winner is the draw
        tl.store(idx_ptr + row, winner.to(tl.int64))
    else:
        tl.store(score_ptr + row * slices + s, top)
        tl.store(idx_ptr + row * slices + s, winner.to(tl.int64))


@triton.jit(do_not_specialize=["slices"])
def _best_slice_kernel(score_ptr, idx_ptr, out_ptr, slices, V: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    mask = s < slices
    score = tl.load(score_ptr + row * slices + s, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * slices + s, mask=mask, other=V)
    top = tl.max(score, 0)
    tl.store(out_ptr + row, tl.min(tl.where(score == top, idx, V), 0))


def gumbel_argmax(logits: torch.Tensor, temperature: float, seed: int, block: int = 2048,
                  slices: int | None = None) -> torch.Tensor:
    """logits [rows, V] (last dim contiguous), temperature > 0 -> sampled ids [rows] int64.
    `slices` per row (at most MAX_SLICES): by default enough that rows x slices fills the GPU."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] with a contiguous last dim; got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    block = min(block, triton.next_power_of_2(vocab))
    tiles = triton.cdiv(vocab, block)
    slices = min(tiles, MAX_SLICES, slices or triton.cdiv(TARGET_PROGRAMS, rows))
    slice_tiles = triton.cdiv(tiles, slices)
    slices = triton.cdiv(tiles, slice_tiles)  # none empty
    args = (logits.stride(0), 1.0 / temperature, seed, slice_tiles * block, slices)
    if slices == 1:
        _gumbel_argmax_kernel[(rows, 1)](logits, out, out, *args, V=vocab, BLOCK=block, DIRECT=True)
        return out
    score = torch.empty(rows, slices, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, slices, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, slices)](logits, score, idx, *args, V=vocab, BLOCK=block, DIRECT=False)
    _best_slice_kernel[(rows,)](score, idx, out, slices, V=vocab, BLOCK_S=MAX_SLICES)
    return out
