"""INT8 x INT8 kernels for W8A8 weights (layers/quant/w8a8.py holds the weights and states the
numerics; its torch functions are the reference these kernels reproduce bit for bit):

    quantize_tokens   x [M, K] (a float dtype) -> (q int8 [M, K], s float32 [M, 1]), a program a row:
                      dynamic   s = max(max_k |x[m, k]|, AMAX_FLOOR) / 127, q = rint(x / s) in [-127, 127]
                      static    s = the per-tensor input scale,         q = rint(x / s) in [-128, 127]
    int8_matmul       y = float32(q @ w^T) * s[m] * s_w[n] (+ bias[n]) in the output dtype: tl.dot on
                      int8 tiles into an int32 accumulator (the int8 tensor-core instructions), the
                      scales and the bias in the epilogue

Both divide as IEEE does (div_rn, as torch's x / s) and round half to even (rint: clamped to
|v| <= 128 first, v + 1.5 * 2^23 - 1.5 * 2^23 in float32, which the interpreter runs too: it has
no libdevice), so q and s are torch's bits. The int32 sum is exact at any tile shape (|sum| <=
K * 128^2 < 2^31 for K < 131072), and the epilogue is compiled without FMA contraction
(enable_fp_fusion False: a multiply then an add, each rounded, as torch does them), so a row's
output is the reference's bits whatever M, the tile config or the other rows of the batch.

Decode-sized M takes this same path, not a weight-only GEMV on bf16 activations: the weight is
read as int8 either way (one byte a value), and only this path gives a row the same answer alone
as in a batch of any size (a weight-only GEMV would skip quantizing the activations).
Allocates by shape alone and never syncs with the host: CUDA graphs capture both kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.tiles import grouped_tile

QMAX = tl.constexpr(127.0)
MAX_BLOCK = 16384  # quantize_tokens holds a row of up to this many values in registers (16 warps: 32 a thread)
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + ROUND - ROUND is v rounded half to even in float32, |v| < 2^22


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, stride_x, stride_q, amax_floor, K: tl.constexpr,
                            STATIC: tl.constexpr, QMIN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if K <= BLOCK:  # the row in registers: read once
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        if STATIC:
            scale = tl.load(in_scale_ptr)
        else:
            scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), 0), amax_floor), QMAX)
        v = tl.clamp(tl.div_rn(x, scale), QMIN, QMAX)
        tl.store(q_ptr + row * stride_q + offs, ((v + ROUND) - ROUND).to(tl.int8), mask=offs < K)
    else:
        if STATIC:
            scale = tl.load(in_scale_ptr)
        else:
            amax = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, K, BLOCK):
                k = k0 + offs
                x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.div_rn(tl.maximum(tl.max(amax, 0), amax_floor), QMAX)
        for k0 in range(0, K, BLOCK):
            k = k0 + offs
            x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            v = tl.clamp(tl.div_rn(x, scale), QMIN, QMAX)
            tl.store(q_ptr + row * stride_q + k, ((v + ROUND) - ROUND).to(tl.int8), mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_tokens(x: torch.Tensor, input_scale: torch.Tensor | None, amax_floor: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float with contiguous rows -> (q int8 [M, K], s float32 [M, 1]): per row (dynamic,
    `input_scale` None, each row's largest magnitude floored at `amax_floor` maps to 127) or by
    the static per-tensor `input_scale` (float32, one element)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be [M, K] float with contiguous rows; got {x.dtype} {tuple(x.shape)}")
    if input_scale is not None and (input_scale.dtype != torch.float32 or input_scale.numel() != 1):
        raise ValueError(f"a static input scale is one float32; got {input_scale.dtype} {tuple(input_scale.shape)}")
    rows, k = x.shape
    block = min(triton.next_power_of_2(k), MAX_BLOCK)  # Llama-8B's down_proj input (14336) in one block
    q = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    s = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        static = input_scale is not None
        _quantize_tokens_kernel[(rows,)](
            x, q, s, input_scale if static else s, x.stride(0), q.stride(0), amax_floor, K=k, STATIC=static,
            QMIN=-128.0 if static else -127.0, BLOCK=block, num_warps=max(4, min(16, block // 1024)))
    return q, s


@triton.jit
def _int8_matmul_kernel(q_ptr, qs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, stride_q, stride_w, stride_y,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        a = tl.load(q_ptr + m[:, None] * stride_q + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0)
        b = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    sa = tl.load(qs_ptr + m, mask=mmask, other=0.0)
    sb = tl.load(ws_ptr + n, mask=nmask, other=0.0)
    y = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


MIN_PROGRAMS = 160  # a tile shape is kept where it makes this many programs (1.2 for each of the H100's 132 SMs)
# row tiles over 16 rows, largest first: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = ((128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (64, 64, 128, 4, 4))


def int8_config(rows: int, n: int, on_gpu: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), from a sweep on the H100 at Llama-3.1-8B's
    shapes (benchmarks/scripts/int8_gemm_bench.py --sweep; BENCHMARKS.md). Up to 16 rows (decode)
    16-row tiles, 32 columns wide (128 for the widest weights, gate|up's 28672 rows: 9 % faster):
    the weight read is the cost. More rows: the largest of TILES that still makes MIN_PROGRAMS
    programs (M = 512: 128 x 128 for q|k|v and gate|up, 64 x 128 for o and down; M = 256: 64 x
    128 for q|k|v, 64 x 64 for o and down; up to 1.6x the fixed 128 x 128 tile at those M). On
    Triton's interpreter the fewest programs run fastest."""
    if not on_gpu:
        return (16 if rows <= 16 else 32), 64, 64, 4, 1
    if rows <= 16:
        return (16, 128, 256, 4, 3) if n >= 16384 else (16, 32, 256, 4, 4)
    for block_m, block_n, block_k, warps, stages in TILES:
        block_m = min(block_m, triton.next_power_of_2(rows))
        if triton.cdiv(rows, block_m) * triton.cdiv(n, block_n) >= MIN_PROGRAMS:
            break
    return block_m, block_n, block_k, warps, stages


def int8_matmul(q: torch.Tensor, q_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """q int8 [M, K] with scales float32 [M, 1]; weight int8 [N, K] with scales float32 [N]; bias
    [N] (any float dtype). Returns y [M, N] in out_dtype."""
    rows, k = q.shape
    n = weight.shape[0]
    if q.dtype != torch.int8 or weight.dtype != torch.int8 or weight.shape[1] != k or q.stride(1) != 1 \
            or weight.stride(1) != 1:
        raise ValueError(f"q [M, K] and weight [N, K] must be int8 with contiguous rows; got {q.dtype} "
                         f"{tuple(q.shape)}, {weight.dtype} {tuple(weight.shape)}")
    if tuple(q_scales.shape) != (rows, 1) or tuple(weight_scales.shape) != (n,) or q_scales.dtype != torch.float32 \
            or weight_scales.dtype != torch.float32 or weight_scales.stride(0) != 1:
        raise ValueError(f"scales must be float32 ({rows}, 1) and ({n},); got {q_scales.dtype} "
                         f"{tuple(q_scales.shape)} and {weight_scales.dtype} {tuple(weight_scales.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    y = torch.empty(rows, n, dtype=out_dtype, device=q.device)
    if rows == 0:
        return y
    block_m, block_n, block_k, warps, stages = config or int8_config(rows, n, q.is_cuda)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _int8_matmul_kernel[grid](
        q, q_scales, weight, weight_scales, bias if bias is not None else weight_scales, y, rows, n, q.stride(0),
        weight.stride(0), y.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return y
