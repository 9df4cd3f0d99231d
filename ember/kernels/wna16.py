"""The matmul of float activations and 4- or 8-bit integer weights (W4A16, W8A16: AWQ, GPTQ
and compressed-tensors checkpoints, read into one layout by layers/quant/int_weight.py),
dequantized in registers, on tensor cores (tl.dot); a few rows take the GEMV of
kernels/int_gemv.py instead.

    qweight  int32 [N, ceil(K / PER)]   PER = 32 / BITS values a word, value k at bits (k % PER) * BITS
    scales   [N, G] float               zeros uint8 [N, G] (none: 2^(BITS - 1))
    g_idx    int32 [K] (none: k // GROUP)
    W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

Tile (pid_m, pid_n) of y [M, N], K in steps of BLOCK_K; the weight tile [BLOCK_N, BLOCK_K] is
read as [BLOCK_N, BLOCK_K / PER] words, each repeated PER times and shifted apart:

    grouped (BLOCK_K divides GROUP, or one group a row): a tile's columns share group g, and
        acc += dot(x[m, k0:k0 + BLOCK_K], (q - z[n, g])^T) * s[n, g]
        (q - z is a small integer, exact in bf16 / fp16: the weight is never rounded)
    per column (act-order g_idx, or a group BLOCK_K does not divide):
        acc += dot(x, ((q - z[n, g(k)]) * s[n, g(k)])^T)    (the weight rounded once to x's dtype)

float32 activations multiply in IEEE float32 (no TF32). Allocates by shape alone and never
syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.tiles import grouped_tile


@triton.jit
def unpack_values(w_ptr, n, nmask, k0, stride_w, K, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The unsigned values of rows n, columns [k0, k0 + BLOCK_K) (k0 a multiple of BLOCK_K,
    itself of 32 / BITS): each int32 word is read once and repeated for its values. (K may be
    a runtime value: the MoE kernels' is.)"""
    PER: tl.constexpr = 32 // BITS
    j = k0 // PER + tl.arange(0, BLOCK_K // PER)
    words = tl.load(w_ptr + n[:, None] * stride_w + j[None, :], mask=nmask[:, None] & (j < tl.cdiv(K, PER))[None, :],
                    other=0)
    words = tl.reshape(tl.broadcast_to(words[:, :, None], [BLOCK_N, BLOCK_K // PER, PER]), [BLOCK_N, BLOCK_K])
    return (words >> ((tl.arange(0, BLOCK_K) % PER) * BITS)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def unpack_tile(w_ptr, s_ptr, z_ptr, g_ptr, n, nmask, k0, stride_w, stride_s, stride_z, K: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[n, k] in float32 for rows n, columns k = [k0, k0 + BLOCK_K), each column with its
    group's scale and zero; 0 outside the masks."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    mask = nmask[:, None] & kmask[None, :]
    q = unpack_values(w_ptr, n, nmask, k0, stride_w, K, BITS, BLOCK_N, BLOCK_K)
    if HAS_G_IDX:
        g = tl.load(g_ptr + k, mask=kmask, other=0)
    else:
        g = k // GROUP
    s = tl.load(s_ptr + n[:, None] * stride_s + g[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + n[:, None] * stride_z + g[None, :], mask=mask, other=0).to(tl.int32)
    else:
        z = 1 << (BITS - 1)
    return (q - z).to(tl.float32) * s


@triton.jit
def _wna16_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr, M, N, stride_x, stride_w, stride_s,
                         stride_z, stride_y, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, GROUPED: tl.constexpr,
                         HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        a = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if GROUPED:
            q = unpack_values(w_ptr, n, nmask, k0, stride_w, K, BITS, BLOCK_N, BLOCK_K)
            g = k0 // GROUP
            if HAS_ZEROS:
                z = tl.load(z_ptr + n * stride_z + g, mask=nmask, other=0).to(tl.int32)
                q = q - z[:, None]
            else:
                q = q - (1 << (BITS - 1))
            s = tl.load(s_ptr + n * stride_s + g, mask=nmask, other=0.0).to(tl.float32)
            part = tl.dot(a, tl.trans(q.to(tl.float32).to(a.dtype)), input_precision=PRECISION)
            acc += part * s[None, :]
        else:
            w = unpack_tile(w_ptr, s_ptr, z_ptr, g_ptr, n, nmask, k0, stride_w, stride_s, stride_z, K, BITS, GROUP,
                            HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def wna16_config(rows: int, on_gpu: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): row tiles from 16 to 128 as M grows.
    Not tuned: a first guess for the H200 to measure. On Triton's interpreter the fewest
    programs run fastest."""
    if not on_gpu:
        return (16 if rows <= 16 else 32), 64, 64, 4, 1
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    return block_m, 128 if block_m >= 64 else 64, 64, 4 if block_m <= 64 else 8, 3


def _rows(t: torch.Tensor) -> bool:
    """Contiguous rows (a one-column tensor's column stride does not matter)."""
    return t.shape[1] <= 1 or t.stride(1) == 1


def check_int_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     g_idx: torch.Tensor | None, bits: int, group_size: int, k: int) -> None:
    """ValueError unless the tensors are an integer weight [N, k] as the module's doc draws it."""
    if bits not in (4, 8):
        raise ValueError(f"integer weights of 4 or 8 bits; got {bits}")
    n = qweight.shape[0]
    words = triton.cdiv(k, 32 // bits)
    groups = scales.shape[-1] if g_idx is not None else triton.cdiv(k, group_size)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, words) or not _rows(qweight):
        raise ValueError(f"qweight must be int32 [{n}, {words}] with contiguous rows for {bits}-bit values of "
                         f"K={k}; got {qweight.dtype} {tuple(qweight.shape)}")
    if tuple(scales.shape) != (n, groups) or not _rows(scales) or not scales.is_floating_point():
        raise ValueError(f"scales must be float [{n}, {groups}] with contiguous rows; got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape or not _rows(zeros)):
        raise ValueError(f"zeros must be uint8 {tuple(scales.shape)}; got {zeros.dtype} {tuple(zeros.shape)}")
    if g_idx is not None and (g_idx.dtype != torch.int32 or tuple(g_idx.shape) != (k,)):
        raise ValueError(f"g_idx must be int32 [{k}]; got {g_idx.dtype} {tuple(g_idx.shape)}")


def wna16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None = None,
                 config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32, contiguous rows) times the integer weight
    [N, K]^T (+ bias [N]) -> y [M, N] in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [M, K] float with contiguous rows; got {x.dtype} {tuple(x.shape)}")
    rows, k = x.shape
    check_int_weight(qweight, scales, zeros, g_idx, bits, group_size, k)
    n = qweight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_m, block_n, block_k, warps, stages = config or wna16_config(rows, x.is_cuda)
    single = g_idx is None and group_size >= k  # one group a row
    divides = group_size & -group_size  # the largest power of two dividing the group size
    grouped = single or (g_idx is None and divides >= 16)
    if grouped and not single:
        block_k = min(block_k, divides)  # a tile inside one group
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _wna16_matmul_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, y, rows, n, x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, y.stride(0), K=k, BITS=bits, GROUP=k if single else group_size,
        GROUPED=grouped, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
