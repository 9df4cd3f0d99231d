"""Linear layers at a decode batch of a few rows on CUDA: y = a @ W^T read at memory speed,
with the small op before the matmul fused in, so a layer launches fewer kernels:

    prologue "none"  a = x
    prologue "norm"  h = x + residual (rounded to the dtype; no residual: h = x),
                     a = rms_norm(h) * norm_weight             -> returns y and h
    prologue "silu"  x = [gate | up]: a = silu(gate) * up

Each prologue rounds as its unfused op does (layers/norm.py, kernels/activation.py). Program
p owns outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of every row: it streams those rows of W
once, in [BLOCK_N, BLOCK_K] tiles along K, and rebuilds `a` tile by tile (x is a few KB, read
from L2). The norm's rms needs the whole of h, so every program first sums h's squares (a
second short pass over x); program 0 alone writes h out.

Two ways to multiply, one kernel (the DOT constexpr):
  FMA  (1 to 4 rows): float32 products summed on the CUDA cores. Fastest for one row times a
       small weight (the 0.6B's layers, the 8B's o_proj).
  DOT  (1 to 16 rows): the tile goes through the tensor cores as W_tile @ a^T, with the rows
       padded to 16 and the weight loads software-pipelined (num_stages). It reads big
       weights at cuBLAS's speed or better (benchmarks/scripts/skinny_gemm_probe.py), so the
       norm or SiLU in front comes free.
The products accumulate in float32 either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4  # FMA: the layers send it one row only (from 2 rows up cuBLAS's GEMMs won on the H200)
MAX_DOT_ROWS = 16
PROLOGUES = {"none": 0, "norm": 1, "silu": 2}


@triton.jit
def _residual_sum(x_ptr, res_ptr, stride_x, stride_r, m, k, mask, HAS_RES: tl.constexpr):
    h = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + m[:, None] * stride_r + k[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, stride_x, stride_r, stride_w, stride_y,
                 stride_h, N, eps, M: tl.constexpr, M_PAD: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, M_PAD)
    mmask = m < M
    kk = tl.arange(0, BLOCK_K)
    if PROLOGUE == 1:
        sumsq = tl.zeros([M_PAD], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            h = _residual_sum(x_ptr, res_ptr, stride_x, stride_r, m, k, mmask[:, None] & (k < K)[None, :], HAS_RES)
            hf = h.to(tl.float32)
            sumsq += tl.sum(hf * hf, 1)
        inv = tl.rsqrt(sumsq / K + eps)
    if DOT:
        acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        xmask = mmask[:, None] & kmask[None, :]
        if PROLOGUE == 0:
            a = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=xmask, other=0.0).to(tl.float32)
        elif PROLOGUE == 1:
            h = _residual_sum(x_ptr, res_ptr, stride_x, stride_r, m, k, xmask, HAS_RES)
            if HAS_RES:
                tl.store(h_ptr + m[:, None] * stride_h + k[None, :], h, mask=xmask & (pid == 0))
            nw = tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            normed = (h.to(tl.float32) * inv[:, None]).to(h.dtype).to(tl.float32)
            a = (nw[None, :] * normed).to(h.dtype).to(tl.float32)
        else:
            gate = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=xmask, other=0.0)
            up = tl.load(x_ptr + m[:, None] * stride_x + K + k[None, :], mask=xmask, other=0.0)
            g = gate.to(tl.float32)
            a = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if DOT:  # `a` holds values of w's dtype (rounded above): the cast back is exact
            acc = tl.dot(w, tl.trans(a.to(w.dtype)), acc)
        else:
            acc += a[:, None, :] * w.to(tl.float32)[None, :, :]
    if DOT:
        y = tl.trans(acc)
    else:
        y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemv_config(rows: int, n: int, k: int, fill_gpu: bool = True) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). One row: the best of a sweep on the H200 at the
    Qwen3-0.6B / Llama-8B shapes (benchmarks/scripts/gemv_bench.py): 4 rows of W a program,
    or 8 rows with 8 warps and long tiles when N is small (<= 2048: few programs). More rows:
    the [rows, BLOCK_N, BLOCK_K] float32 accumulator fits 64 registers a thread. On Triton's
    interpreter (fill_gpu False) the fewest programs run fastest."""
    m_pad = triton.next_power_of_2(rows)
    block_k = min(512 // m_pad, triton.next_power_of_2(k))
    if not fill_gpu:
        return 8192 // (m_pad * block_k), block_k, 4
    if rows == 1:
        return (8, min(1024, triton.next_power_of_2(k)), 8) if n <= 2048 else (4, block_k, 4)
    block_n = 8192 // (m_pad * block_k)
    while block_n > 4 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, block_k, 4


def dot_config(n: int, k: int, fill_gpu: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of the DOT kernel: the best of
    skinny_gemm_probe.py's grid on the H200 at the 0.6B / 8B shapes. 64 x 128 tiles, 4 stages
    where N >= 1.5 K (q|k|v, gate|up, the LM head); 32 x 256, 3 stages where outputs are few
    for the K walked (o_proj). Small tiles on the interpreter."""
    if not fill_gpu:
        return 16, min(64, max(16, triton.next_power_of_2(k))), 4, 1
    return (64, 128, 4, 4) if 2 * n >= 3 * k else (32, 256, 4, 3)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         config: tuple[int, ...] | None = None, dot: bool = False):
    """x [M, K] ([M, 2K] for "silu"), weight [N, K] with contiguous rows, bias [N]; M up to
    MAX_ROWS, or MAX_DOT_ROWS with `dot` (tensor cores; bfloat16 or float16). Returns y [M, N];
    with prologue "norm" returns (y, h) where h = x + residual (a new tensor; x itself when
    residual is None). `config`: gemv_config's or dot_config's tuple, to override."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    width = 2 * k if prologue == "silu" else k
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"x must be [M, {width}] with contiguous rows in weight's dtype {weight.dtype}; got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, weight strides {weight.stride()}")
    most = MAX_DOT_ROWS if dot else MAX_ROWS
    if not 0 < rows <= most:
        raise ValueError(f"gemv takes 1 to {most} rows{' with dot' if dot else ''}, got {rows}: use F.linear")
    if dot and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the tensor-core path takes bfloat16 or float16, got {x.dtype}: use dot=False")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if prologue == "norm" and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"the norm prologue needs norm_weight [{k}]")
    if residual is not None and (prologue != "norm" or residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual goes with the norm prologue and x's shape {tuple(x.shape)}")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    if dot:
        block_n, block_k, warps, stages = config or dot_config(n, k, x.is_cuda)
        launch = dict(num_warps=warps, num_stages=stages)
        m_pad = max(16, triton.next_power_of_2(rows))  # the smallest tensor-core tile
    else:
        block_n, block_k, warps = config or gemv_config(rows, n, k, x.is_cuda)
        launch = dict(num_warps=warps)
        m_pad = triton.next_power_of_2(rows)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, y, h, x.stride(0), residual.stride(0) if residual is not None else 0,
        weight.stride(0), y.stride(0), h.stride(0), n, eps, M=rows, M_PAD=m_pad, K=k,
        BLOCK_N=block_n, BLOCK_K=block_k, PROLOGUE=PROLOGUES[prologue], HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, DOT=dot, **launch)
    return (y, h) if prologue == "norm" else y
