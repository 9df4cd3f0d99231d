"""FP8 (e4m3) matmul kernels for layers/quant/fp8.py, which holds the weights and picks the
path per shape:

    quantize_groups   activations -> fp8 with a float32 scale per (row, group of columns):
                      group = the whole row (per token, for torch._scaled_mm) or 128 columns
                      (per token per 128-group, for block-scaled weights)
    fp8_matmul        y = (q * s_q) @ (w * s_w)^T (+ bias) from fp8 activations and weights,
                      the weight's scales per output row or per 128 x 128 block

Scales are dequantization multipliers: x ~ q * s. A row's (group's) scale is its largest
magnitude, floored at `amax_floor` so that an all-zero row stays finite, over 448 (the e4m3
maximum); q = x / s is rounded to nearest even (IEEE division, then cvt.rn.satfinite), as
layers/quant/fp8.py's torch reference does, so the two agree exactly.

fp8_matmul tile (pid_m, pid_n) of y [M, N], K in steps of BLOCK_K = 128 (one scale group):

    block-scaled:  acc += dot(q[m, k0:k0+128], w[n, k0:k0+128]^T) * s_q[m, k0/128] * s_w[n/128, k0/128]
    per row:       acc += dot(...);  y = acc * s_q[m] * s_w[n]   (both scales factor out of the sum)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.paged import FP8_MAX
from ember.kernels.tiles import grouped_tile

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # block-scaled weights: 128 x 128 (DeepSeek-V3, Qwen3-FP8); activation groups: 128


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K, amax_floor,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    start = group * GROUP
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, GROUP, BLOCK):
        k = start + k0 + offs
        mask = (k0 + offs < GROUP) & (k < K)
        x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.div_rn(tl.maximum(tl.max(amax, 0), amax_floor), FP8_MAX)  # IEEE, as torch: the same scale
    for k0 in range(0, GROUP, BLOCK):
        k = start + k0 + offs
        mask = (k0 + offs < GROUP) & (k < K)
        x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + group, scale)


def quantize_groups(x: torch.Tensor, group: int | None, amax_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with contiguous rows -> (q float8_e4m3fn [M, K], scales float32 [M, G]):
    G = 1 (group None: one scale per row) or ceil(K / group)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows; got {tuple(x.shape)} strides {x.stride()}")
    rows, k = x.shape
    group = group or k
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_groups_kernel[(rows, groups)](x, q, scales, x.stride(0), q.stride(0), scales.stride(0), k,
                                                amax_floor, GROUP=group, BLOCK=min(triton.next_power_of_2(group), 2048))
    return q, scales


@triton.jit
def _fp8_matmul_kernel(q_ptr, qs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, stride_q, stride_qs, stride_w,
                       stride_ws, stride_y, K: tl.constexpr, BLOCKWISE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SCALE_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k = kb * BLOCK_K + kk
        kmask = k < K
        a = tl.load(q_ptr + m[:, None] * stride_q + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b))
        if BLOCKWISE:
            sa = tl.load(qs_ptr + m * stride_qs + kb, mask=mmask, other=0.0)
            sb = tl.load(ws_ptr + (n // SCALE_N) * stride_ws + kb, mask=nmask, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if not BLOCKWISE:
        sa = tl.load(qs_ptr + m * stride_qs, mask=mmask, other=0.0)
        sb = tl.load(ws_ptr + n, mask=nmask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def matmul_config(rows: int, on_gpu: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 128-wide column tiles (one weight scale
    block), row tiles from 16 to 128 as M grows. Not tuned: the lead measures it on the H200
    (benchmarks/scripts/fp8_gemm_bench.py)."""
    if not on_gpu:
        return 16 if rows <= 16 else 32, 128, 4, 1
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    return block_m, 128, 4 if block_m <= 64 else 8, 3


def fp8_matmul(q: torch.Tensor, q_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype,
               config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """q fp8 [M, K] with scales [M, ceil(K / 128)] (block-scaled weight) or [M, 1] (per-row
    weight); weight fp8 [N, K] with scales [ceil(N / 128), ceil(K / 128)] or [N]; bias [N].
    Returns y [M, N] in out_dtype."""
    rows, k = q.shape
    n = weight.shape[0]
    blockwise = weight_scales.dim() == 2
    want_q = (rows, triton.cdiv(k, SCALE_BLOCK)) if blockwise else (rows, 1)
    want_w = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) if blockwise else (n,)
    if q.dtype != FP8 or weight.dtype != FP8 or weight.shape[1] != k or q.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"q [M, K] and weight [N, K] must be float8_e4m3fn with contiguous rows; got "
                         f"{q.dtype} {tuple(q.shape)}, {weight.dtype} {tuple(weight.shape)}")
    if tuple(q_scales.shape) != want_q or tuple(weight_scales.shape) != want_w or weight_scales.stride(-1) != 1 \
            or q_scales.dtype != torch.float32 or weight_scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 {want_q} and {want_w}; got {tuple(q_scales.shape)} and "
                         f"{tuple(weight_scales.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    y = torch.empty(rows, n, dtype=out_dtype, device=q.device)
    if rows == 0:
        return y
    block_m, block_n, warps, stages = config or matmul_config(rows, q.is_cuda)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _fp8_matmul_kernel[grid](
        q, q_scales, weight, weight_scales, bias if bias is not None else weight_scales, y, rows, n,
        q.stride(0), q_scales.stride(0), weight.stride(0), weight_scales.stride(0) if blockwise else 1, y.stride(0),
        K=k, BLOCKWISE=blockwise, HAS_BIAS=bias is not None, SCALE_N=SCALE_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=SCALE_BLOCK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
