"""Sampling at one temperature in one pass over the logits (Gumbel-max): token
argmax_i(logit_i / T + G_i), G_i = -log(-log U_i), U_i ~ U[0, 1), picks token i with
probability softmax(logits / T)_i. The kernel ranks the same scores in base 2,
logit_i * log2(e) / T - log2(-log2 U_i) (the natural-log score times log2(e), plus a
constant), and takes four uniforms from each Philox call: a tile of BLOCK columns is four
quarters, and column q * BLOCK / 4 + j of tile t uses output q of
Philox(seed, (row * tiles + t) * BLOCK / 4 + j). On CUDA the logs are the hardware's
approximate log2 (see `_exp2_draw` for u near 1). The draws and logs are the kernel's whole
cost (it is compute-bound): 256 rows of Qwen3's logits took 244 µs on the H200 with a Philox
call and two natural logs a column, 150 with four uniforms a call, 82 with the fast log2.

Program (r, s) walks slice s of row r in BLOCK-wide tiles, keeping the best score and its
index. Rows are cut into slices so that rows x slices programs fill the GPU (one request:
75 slices of its 151936 logits); a second kernel then picks each row's best slice. Ties go to the
smallest index either way, so the draw does not depend on the slicing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

TARGET_PROGRAMS = 1056  # ~8 an SM on an H200: the Philox draws and logs keep each one busy
MAX_SLICES = 128
LOG2E = 1.4426950408889634


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:  # lg2.approx (absolute error ~2^-22): CUDA only, not in Triton's interpreter
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _exp2_draw(u, FAST: tl.constexpr):
    """-log2(u) to ~1e-5 relative over all of (0, 1). Near u = 1 the result is tiny, the
    approximate log2's absolute error is not, and those draws are the large Gumbel values
    that let unlikely tokens win: there (1 - u < 1/64, exact) the series
    -log2(1 - w) = log2(e) (w + w^2/2 + w^3/3 + w^4/4 + ...) takes over."""
    w = 1.0 - u
    series = 1.4426950408889634 * w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * 0.25)))
    return tl.where(w < 0.015625, series, -_log2(u, FAST))


@triton.jit
def _keep_best(x, u, cols, scale, best, best_idx, V: tl.constexpr, FAST: tl.constexpr):
    score = tl.where(cols < V, x * scale - _log2(_exp2_draw(u, FAST), FAST), float("-inf"))
    better = score > best  # per lane, columns come in increasing order: the first maximum wins ties
    return tl.where(better, score, best), tl.where(better, cols, best_idx)


# Every argument that changes from step to step (the seed, the slicing, which follows the
# batch size) is a plain runtime value: a new constexpr or specialization would compile a
# new kernel in the middle of serving (seconds each; the first engine of a device call ran
# several times slower from that).
@triton.jit(do_not_specialize=["seed", "slice_len", "slices"])
def _gumbel_argmax_kernel(logits_ptr, score_ptr, idx_ptr, stride, scale, seed, slice_len, slices,
                          V: tl.constexpr, BLOCK: tl.constexpr, DIRECT: tl.constexpr,
                          FAST: tl.constexpr):
    row = tl.program_id(0)
    s = tl.program_id(1)
    Q: tl.constexpr = BLOCK // 4
    TILES: tl.constexpr = (V + BLOCK - 1) // BLOCK
    lane = tl.arange(0, Q)
    best = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.zeros([Q], tl.int32)
    base = logits_ptr + row * stride
    for start in range(s * slice_len, tl.minimum((s + 1) * slice_len, V), BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, (row * TILES + start // BLOCK) * Q + lane)
        c0 = start + lane
        c1 = c0 + Q
        c2 = c1 + Q
        c3 = c2 + Q
        x0 = tl.load(base + c0, mask=c0 < V, other=float("-inf")).to(tl.float32)
        x1 = tl.load(base + c1, mask=c1 < V, other=float("-inf")).to(tl.float32)
        x2 = tl.load(base + c2, mask=c2 < V, other=float("-inf")).to(tl.float32)
        x3 = tl.load(base + c3, mask=c3 < V, other=float("-inf")).to(tl.float32)
        best, best_idx = _keep_best(x0, u0, c0, scale, best, best_idx, V, FAST)
        best, best_idx = _keep_best(x1, u1, c1, scale, best, best_idx, V, FAST)
        best, best_idx = _keep_best(x2, u2, c2, scale, best, best_idx, V, FAST)
        best, best_idx = _keep_best(x3, u3, c3, scale, best, best_idx, V, FAST)
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
                  slices: int | None = None, fast_log: bool | None = None) -> torch.Tensor:
    """logits [rows, V] (last dim contiguous), temperature > 0 -> sampled ids [rows] int64.
    `slices` per row (at most MAX_SLICES): by default enough that rows x slices fills the GPU.
    `fast_log`: the hardware's approximate log2 (default: on CUDA)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, V] with a contiguous last dim; got {tuple(logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    block = max(4, min(block, triton.next_power_of_2(vocab)))  # four quarters a tile
    tiles = triton.cdiv(vocab, block)
    slices = min(tiles, MAX_SLICES, slices or triton.cdiv(TARGET_PROGRAMS, rows))
    slice_tiles = triton.cdiv(tiles, slices)
    slices = triton.cdiv(tiles, slice_tiles)  # none empty
    args = (logits.stride(0), LOG2E / temperature, seed, slice_tiles * block, slices)
    consts = dict(V=vocab, BLOCK=block, FAST=logits.is_cuda if fast_log is None else fast_log)
    if slices == 1:
        _gumbel_argmax_kernel[(rows, 1)](logits, out, out, *args, DIRECT=True, **consts)
        return out
    score = torch.empty(rows, slices, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, slices, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, slices)](logits, score, idx, *args, DIRECT=False, **consts)
    _best_slice_kernel[(rows,)](score, idx, out, slices, V=vocab, BLOCK_S=MAX_SLICES)
    return out
