"""Warm the L2 cache with part of a weight that the next matmul will read.

In a decode step of a few rows, every matmul streams its weight from HBM, and between
two matmuls run small kernels (RoPE, attention, norms) that leave HBM nearly idle. A
prefetch launched before them fills that time: its programs only issue L2 prefetches and
exit (`prefetch.global.L2`, no register holds the data, nothing waits), so the small
kernels run on while HBM loads the lines, and the matmul then finds them in L2.

Which lines: `fraction` of the weight's 128-byte lines, spread evenly (the first t of
every g lines), so every program of the matmul, however it tiles the weight, finds the
same share in L2. CUDA only (sm80+); the interpreter cannot run PTX, so the wrapper does
nothing off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128  # bytes
HINTS = {"normal": 0, "last": 1}  # the lines' eviction priority in L2


@triton.jit
def _prefetch_kernel(w_ptr, n_lines, n_take, GROUP: tl.constexpr, TAKE: tl.constexpr,
                     LINE_ELEMS: tl.constexpr, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    line = (j // TAKE) * GROUP + j % TAKE
    mask = (j < n_take) & (line < n_lines)
    ptrs = w_ptr + tl.where(mask, line, 0).to(tl.int64) * LINE_ELEMS
    # not pure: the compiler keeps the asm although its (dummy) result goes unused
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def split_fraction(fraction: float) -> tuple[int, int]:
    """(group, take): take the first `take` lines of every `group`, closest to `fraction`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the prefetched fraction must be in (0, 1], got {fraction}")
    if fraction >= 1 / 8:
        return 8, max(1, round(8 * fraction))
    return round(1 / fraction), 1


def prefetch_l2(weight: torch.Tensor, fraction: float, hint: str = "normal", block: int = 1024):
    """Issue L2 prefetches for `fraction` of a contiguous CUDA tensor's lines; nothing waits
    for the lines. Returns the launched kernel (its PTX for a test), None off CUDA."""
    group, take = split_fraction(fraction)
    if hint not in HINTS:
        raise ValueError(f"hint must be one of {sorted(HINTS)}, got {hint!r}")
    if not weight.is_cuda:
        return None
    if not weight.is_contiguous():
        raise ValueError(f"prefetch_l2 needs a contiguous tensor; got strides {weight.stride()}")
    n_lines = weight.numel() * weight.element_size() // LINE
    n_take = triton.cdiv(n_lines, group) * take
    if n_take == 0:
        return None
    return _prefetch_kernel[(triton.cdiv(n_take, block),)](
        weight, n_lines, n_take, GROUP=group, TAKE=take, LINE_ELEMS=LINE // weight.element_size(), BLOCK=block,
        EVICT_LAST=HINTS[hint], num_warps=4)
