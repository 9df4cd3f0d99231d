"""Linear layers at a decode batch of one row (the kernel takes up to 4) on CUDA:
y = a @ W^T read at memory speed, with the small op before the matmul fused in, so a layer
launches fewer kernels:

    prologue "none"  a = x
    prologue "norm"  h = x + residual (rounded to the dtype; no residual: h = x),
                     a = rms_norm(h) * norm_weight             -> returns y and h
    prologue "silu"  x = [gate | up]: a = silu(gate) * up

Each prologue rounds as its unfused op does (layers/norm.py, kernels/activation.py), then
the dot accumulates in float32. Program p owns outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of
every row: it streams those rows of W once, in [BLOCK_N, BLOCK_K] tiles along K, and
rebuilds `a` tile by tile (x is a few KB, read from L2). The norm's rms needs the whole of
h, so every program first sums h's squares (a second short pass over x); program 0 alone
writes h out.

FP8 weights (layers/quant/fp8.py: float8_e4m3fn W with float32 scales) are dequantized in
registers while the activations stay in their dtype (weight-only: a decode step reads half
the bytes, and quantizes nothing): with a scale per output row, y[n] = scale[n] * sum_k
a[k] W[n, k] (applied once, after the sum); with a scale per 128 x 128 block, each weight
element times scale[n // 128, k // 128] in the tile.

Integer weights (4 or 8 bits with group scales, layers/quant/int_weight.py; the layout is
kernels/wna16.py's) are unpacked and dequantized to float32 in the tile the same way, each
column with its group's scale and zero (act-order g_idx too): what kernels/int_gemv.py's word
kernel leaves to it (uneven act-order groups, groups that cut an int32 word).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.wna16 import check_int_weight, unpack_tile

MAX_ROWS = 4  # bf16 layers send one row (from 2 rows up cuBLAS won on the H200), FP8 layers up to 4
PROLOGUES = {"none": 0, "norm": 1, "silu": 2}
FP8_SCALE_BLOCK = 128  # block-scaled fp8 weights: one scale per 128 x 128 block


@triton.jit
def _residual_sum(x_ptr, res_ptr, rows, cols, mask, stride_x, stride_r, HAS_RES: tl.constexpr):
    """h = x + residual (rounded to x's dtype; x alone without one) at rows x cols."""
    h = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def inv_rms(x_ptr, res_ptr, m, mmask, stride_x, stride_r, eps, K: tl.constexpr, M_PAD: tl.constexpr,
            BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr):
    """1 / rms(h) of each row m of h = x + residual: float32 [M_PAD] (the norm prologue's first pass)."""
    kk = tl.arange(0, BLOCK_K)
    sumsq = tl.zeros([M_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        h = _residual_sum(x_ptr, res_ptr, m[:, None], k[None, :], mmask[:, None] & (k < K)[None, :], stride_x,
                          stride_r, HAS_RES)
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, 1)
    return tl.rsqrt(sumsq / K + eps)


@triton.jit
def prologue_input(x_ptr, res_ptr, nw_ptr, h_ptr, rows, cols, mask, cmask, inv, write_h, stride_x, stride_r,
                   stride_h, K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):
    """The GEMV's input a = prologue(x) in float32 at rows x cols (offset tensors that broadcast
    to `mask`'s shape; `cmask` the columns' mask, `inv` shaped as rows: inv_rms's). "norm"
    writes h = x + residual where `write_h` (one program) and there is a residual."""
    if PROLOGUE == 0:
        a = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    elif PROLOGUE == 1:
        h = _residual_sum(x_ptr, res_ptr, rows, cols, mask, stride_x, stride_r, HAS_RES)
        if HAS_RES:
            tl.store(h_ptr + rows * stride_h + cols, h, mask=mask & write_h)
        nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        normed = (h.to(tl.float32) * inv).to(h.dtype).to(tl.float32)
        a = (nw * normed).to(h.dtype).to(tl.float32)
    else:
        gate = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + rows * stride_x + K + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return a


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, h_ptr, stride_x, stride_r,
                 stride_w, stride_s, stride_z, stride_y, stride_h, N, eps, M: tl.constexpr, M_PAD: tl.constexpr,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr,
                 HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr):
    # SCALE: 0 plain weight, 1 fp8 with a scale per output row, 2 fp8 with a scale per block,
    # 3 integers of BITS bits with group scales (GROUP columns a group, or g_idx), zeros
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, M_PAD)
    mmask = m < M
    kk = tl.arange(0, BLOCK_K)
    inv = tl.zeros([M_PAD], tl.float32)
    if PROLOGUE == 1:
        inv = inv_rms(x_ptr, res_ptr, m, mmask, stride_x, stride_r, eps, K, M_PAD, BLOCK_K, HAS_RES)
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        a = prologue_input(x_ptr, res_ptr, nw_ptr, h_ptr, m[:, None], k[None, :], mmask[:, None] & kmask[None, :],
                           kmask[None, :], inv[:, None], pid == 0, stride_x, stride_r, stride_h, K, PROLOGUE, HAS_RES)
        wmask = nmask[:, None] & kmask[None, :]
        if SCALE == 3:
            w = unpack_tile(w_ptr, s_ptr, z_ptr, g_ptr, n, nmask, k0, stride_w, stride_s, stride_z, K, BITS, GROUP,
                            HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=wmask, other=0.0).to(tl.float32)
        if SCALE == 2:
            w *= tl.load(s_ptr + (n // SCALE_BLOCK)[:, None] * stride_s + (k // SCALE_BLOCK)[None, :], mask=wmask,
                         other=0.0)
        acc += a[:, None, :] * w[None, :, :]
    y = tl.sum(acc, 2)
    if SCALE == 1:
        y *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gemv_config(rows: int, n: int, k: int, fill_gpu: bool = True, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). One row: the best of a sweep on the H200 at the
    Qwen3-0.6B / Llama-8B shapes (benchmarks/scripts/gemv_bench.py): 4 rows of W a program,
    or 8 rows with 8 warps and long tiles when N is small (<= 2048: few programs); fp8
    weights (half the bytes a value): 8 rows of 1024 with 4 warps at every Llama-8B shape
    (fp8_gemm_bench.py --sweep: 9-24 % faster than the bf16 choice); integer weights take
    the fp8 choice (`fp8` True: a first guess, not measured). More rows: the
    [rows, BLOCK_N, BLOCK_K] float32 accumulator fits 64 registers a thread. On Triton's
    interpreter (fill_gpu False) the fewest programs run fastest."""
    m_pad = triton.next_power_of_2(rows)
    block_k = min(512 // m_pad, triton.next_power_of_2(k))
    if not fill_gpu:
        return 8192 // (m_pad * block_k), block_k, 4
    if rows == 1 and fp8:
        return 8, min(1024, triton.next_power_of_2(k)), 4
    if rows == 1:
        return (8, min(1024, triton.next_power_of_2(k)), 8) if n <= 2048 else (4, block_k, 4)
    block_n = 8192 // (m_pad * block_k)
    while block_n > 4 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, block_k, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         config: tuple[int, int, int] | None = None, weight_scale: torch.Tensor | None = None,
         weight_zeros: torch.Tensor | None = None, g_idx: torch.Tensor | None = None, bits: int = 0,
         group_size: int = 0):
    """x [M <= MAX_ROWS, K] ([M, 2K] for "silu"), weight [N, K] with contiguous rows, bias [N].
    Returns y [M, N]; with prologue "norm" returns (y, h) where h = x + residual (a new
    tensor; x itself when residual is None). A float8_e4m3fn weight comes with
    `weight_scale`, float32 [N] (per row) or [ceil(N / 128), ceil(K / 128)] (per block), and
    x in a float dtype of its own; an int32 weight is `bits`-bit integers packed as
    kernels/wna16.py draws them, with `weight_scale` [N, G], `weight_zeros`, `g_idx` and
    `group_size`; otherwise x is in weight's dtype."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if weight.dtype == torch.int32:
        k = x.shape[-1] // 2 if prologue == "silu" else x.shape[-1]
        check_int_weight(weight, weight_scale, weight_zeros, g_idx, bits, group_size, k)
        scale_mode = 3
    else:
        scale_mode = _check_scale(weight, weight_scale)
    width = 2 * k if prologue == "silu" else k
    want = x.dtype in (torch.bfloat16, torch.float16, torch.float32) if scale_mode else x.dtype == weight.dtype
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 or weight.stride(1) != 1 or not want:
        raise ValueError(f"x must be [M, {width}] with contiguous rows in "
                         f"{'a float dtype' if scale_mode else f'weight dtype {weight.dtype}'}; got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}, weight strides {weight.stride()}")
    check_gemv_args(x, n, k, bias, prologue, residual, norm_weight, MAX_ROWS, "gemv", "F.linear")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    block_n, block_k, warps = config or gemv_config(rows, n, k, x.is_cuda, fp8=bool(scale_mode))
    scale = weight_scale if weight_scale is not None else weight
    zeros = weight_zeros if weight_zeros is not None else scale
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight, scale,
        zeros, g_idx if g_idx is not None else weight, bias if bias is not None else weight, y, h, x.stride(0),
        residual.stride(0) if residual is not None else 0, weight.stride(0),
        scale.stride(0) if scale_mode in (2, 3) else 0, zeros.stride(0) if weight_zeros is not None else 0,
        y.stride(0), h.stride(0), n, eps, M=rows, M_PAD=triton.next_power_of_2(rows), K=k, BLOCK_N=block_n,
        BLOCK_K=block_k, PROLOGUE=PROLOGUES[prologue], HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        SCALE=scale_mode, SCALE_BLOCK=FP8_SCALE_BLOCK, BITS=bits or 4, GROUP=group_size or 1,
        HAS_ZEROS=weight_zeros is not None, HAS_G_IDX=g_idx is not None, num_warps=warps)
    return (y, h) if prologue == "norm" else y


def check_gemv_args(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None, prologue: str,
                    residual: torch.Tensor | None, norm_weight: torch.Tensor | None, max_rows: int, name: str,
                    instead: str) -> None:
    """ValueError unless x's rows (1 to max_rows), the bias [n] and the prologue's tensors fit a GEMV
    over K = k: what every GEMV wrapper checks (`name` and the call to use `instead` of it for
    more rows go into the message)."""
    rows = x.shape[0]
    if not 0 < rows <= max_rows:
        raise ValueError(f"{name} takes 1 to {max_rows} rows, got {rows}: use {instead}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if prologue == "norm" and (norm_weight is None or norm_weight.shape != (k,)):
        raise ValueError(f"the norm prologue needs norm_weight [{k}]")
    if residual is not None and (prologue != "norm" or residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual goes with the norm prologue and x's shape {tuple(x.shape)}")


def _check_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The kernel's SCALE mode for this weight: 0 plain, 1 fp8 per row, 2 fp8 per block."""
    if weight.dtype != torch.float8_e4m3fn:
        if scale is not None:
            raise ValueError(f"weight_scale goes with a float8_e4m3fn weight, not {weight.dtype}")
        return 0
    n, k = weight.shape
    blocks = (triton.cdiv(n, FP8_SCALE_BLOCK), triton.cdiv(k, FP8_SCALE_BLOCK))
    if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) not in ((n,), blocks) \
            or scale.stride(-1) != 1:
        raise ValueError(f"a float8_e4m3fn weight [{n}, {k}] needs weight_scale float32 [{n}] or {list(blocks)}; "
                         f"got {None if scale is None else (scale.dtype, tuple(scale.shape))}")
    return 1 if scale.dim() == 1 else 2
