"""y = x @ W^T (+ bias) on CUDA with one order of arithmetic for every row count: the batch-
invariant matmul of deterministic mode (layers/batch_invariant.py).

cuBLAS picks its kernel by the shape, split-K included, so a row's bits depend on how many
rows share the call. Here every output element is one program's float32 sum over K in
BLOCK_K tiles, in order, each tile one `tl.dot` (tensor-core MMAs of k16) into the same
accumulator; K is never split. The tile shape along M and N only decides which program
computes an element, not how: configs that share BLOCK_K (and the MMA kind: BLOCK_M >= 64,
4 or 8 warps, Hopper's wgmma) give the same bits, which tests/kernels/test_matmul.py checks
on the GPU for every pair in CONFIGS. So a step takes the tile that fits its row count:

    rows <= 64   BLOCK_M 64,  BLOCK_N 32    (decode: enough programs to stream W at speed)
    rows >  64   BLOCK_M 128, BLOCK_N 128   (prefill: tiles big enough to be compute-bound)

Programs go in grouped order (kernels/tiles.py) so a column tile of W is read once into L2.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.tiles import grouped_tile

BLOCK_K = 64  # the order of the sum over K: fixed for every config
# (rows up to, BLOCK_M, BLOCK_N, num_warps, num_stages); the last takes every larger row count
CONFIGS = ((64, 64, 32, 4, 6), (None, 128, 128, 8, 3))
# EMBER_INVARIANT_MATMUL="128,128,8,3" runs every row count on that one config (a sweep, or a
# GPU whose MMAs round by the tile: then one config for all is the invariant choice)
_OVERRIDE = os.environ.get("EMBER_INVARIANT_MATMUL")
if _OVERRIDE:
    CONFIGS = ((None, *(int(v) for v in _OVERRIDE.split(","))),)


# the row count changes from step to step: not specialized on (a count of 1 or a multiple of 16
# would each compile another kernel mid-serving)
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_rows = w_ptr + rn[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        a = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_rows + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def config_for(rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a call of `rows` rows."""
    return next(c[1:] for c in CONFIGS if c[0] is None or rows <= c[0])


def invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) in x's dtype, float32 sums (float32 inputs
    multiplied in full precision, as torch's default, not TF32); `config` forces a tile
    (tests). Each row's bits are the same whatever the call's row count."""
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}"
                         f"{'' if bias is None else f' and bias {tuple(bias.shape)}'}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1 or weight.stride(-1) != 1:
        rows, weight = rows.contiguous(), weight.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, warps, stages = config or config_for(m)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _matmul_kernel[grid](rows, weight, bias if bias is not None else weight, y, m, n, k, rows.stride(0),
                             weight.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                             GROUP_M=8, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y.view(*x.shape[:-1], n)
