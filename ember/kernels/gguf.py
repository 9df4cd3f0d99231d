"""GGUF block-quantized weights on CUDA (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K),
dequantized in registers: a GEMV for a few rows (float32 arithmetic, the prologues of
kernels/gemv.py fused in), a matmul on tensor cores for more (each weight tile dequantized
to x's dtype, then tl.dot), and a gather of rows (an embedding lookup). In the matmul, the
gather and this file's per-value GEMV each weight value is ggml's decoder's float32 value bit
for bit (layers/quant/ggml.py, gguf-py's numpy decoders): the same products and the same one
rounding. gguf_gemv sends Q4_0, Q4_1, Q8_0, Q4_K and Q6_K to kernels/gguf_gemv.py's word
GEMV instead (its weight read once for all rows, the dot factored: the scales multiply sums
of x q once a sub-block, so y is within a few float32 roundings of the matmul over ggml's
values, not equal to it); Q5_0, Q5_1 and Q5_K (and per_value) take the per-value GEMV here.

The weight is the file's bytes split into planes at load (layers/quant/gguf_cuda.py), each
[N, per row] with contiguous rows, in the file's order (only the K-quants' packed 6-bit
scales are unpacked, 12 bytes a super-block become 16):

    type   qs (values)        qh (high bits)       d        m (minimum)   sc, mn (sub-block)
    Q4_0   uint8 [K/2]                             f16 /32
    Q4_1   uint8 [K/2]                             f16 /32  f16 /32
    Q5_0   uint8 [K/2]        int32 [K/32]         f16 /32
    Q5_1   uint8 [K/2]        int32 [K/32]         f16 /32  f16 /32
    Q8_0   int8 [K]                                f16 /32
    Q4_K   uint8 [K/2]                             f16 /256 f16 /256      uint8 [K/32] each
    Q5_K   uint8 [K/2]        uint8 [K/8]          f16 /256 f16 /256      uint8 [K/32] each
    Q6_K   uint8 [K/2] (ql)   uint8 [K/4]          f16 /256               int8 [K/16] (sc)

Every type is read in groups of 32 values: group g is 16 bytes of qs (Q8_0: 32), whose low
nibbles are 16 consecutive values and whose high nibbles are the 16 values SPAN / 2 further
on. SPAN is how far a type's nibbles reach: 32 (Q4_0 .. Q5_1, and Q8_0's two halves), 64
(Q4_K, Q5_K: 32 bytes hold 64 values), 128 (Q6_K: 64 bytes of ql hold 128 values):

    lo column of (g, l) = SPAN * (g // PER) + 16 * (g % PER) + l,  PER = SPAN / 32, l < 16
    hi column           = lo column + SPAN / 2

    Q4_K, g = 8s + 2c + e:   qs bytes 16g .. 16g + 15 = super-block s, chunk c, half e
              lo: values 256s + 64c + 16e + l (sub-block 8s + 2c), hi: + 32 (sub-block 8s + 2c + 1)
    Q6_K, g = 8s + 4h + i:   lo: values 256s + 128h + 16i + l (scale 16s + 8h + i), hi: + 64 (scale + 4)

so a tile of GROUPS groups is GROUPS x 16 bytes read contiguously, two [BLOCK_N, GROUPS, 16]
tiles of values (lo, hi), and x read at their columns (runs of 16). The scales are per group
(Q6_K's 16 values, the others' 32), loaded [BLOCK_N, GROUPS] and broadcast over the 16.

Allocates by shape alone and never syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.gemv import PROLOGUES, check_gemv_args, inv_rms, prologue_input
from ember.kernels.gguf_gemv import WORD_TYPES, gguf_word_gemv
from ember.kernels.tiles import grouped_tile

# ggml type id -> SPAN (see above)
SPANS = {2: 32, 3: 32, 6: 32, 7: 32, 8: 32, 12: 64, 13: 64, 14: 128}
MAX_ROWS = 4  # the GEMV's rows; more take the matmul


@triton.jit
def _columns(g, SPAN: tl.constexpr):
    """The lo column of each group's first value (hi: + SPAN / 2)."""
    PER: tl.constexpr = SPAN // 32
    return SPAN * (g // PER) + 16 * (g % PER)


@triton.jit
def _group_values(q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, n, nmask, g, gmask, K: tl.constexpr,
                  QTYPE: tl.constexpr):
    """Rows n [BLOCK_N] x groups g [GROUPS] of the weight -> (lo, hi), float32 [BLOCK_N, GROUPS, 16]:
    the values at the groups' lo and hi columns, as ggml decodes them; 0 outside the masks."""
    l = tl.arange(0, 16)[None, None, :]
    row = n.to(tl.int64)
    r3 = row[:, None, None]
    g3 = g[None, :, None]
    mask = (nmask[:, None] & gmask[None, :])[:, :, None]
    r2 = row[:, None]
    g2 = g[None, :]
    mask2 = nmask[:, None] & gmask[None, :]
    if QTYPE == 8:  # Q8_0: value = q * d
        qrow = q_ptr + r3 * K + g3 * 32 + l
        d = tl.load(d_ptr + r2 * (K // 32) + g2, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
        lo = tl.load(qrow, mask=mask, other=0).to(tl.float32) * d
        hi = tl.load(qrow + 16, mask=mask, other=0).to(tl.float32) * d
    else:
        byte = tl.load(q_ptr + r3 * (K // 2) + g3 * 16 + l, mask=mask, other=0).to(tl.int32)
        qlo = byte & 0xF
        qhi = byte >> 4
        if QTYPE == 6 or QTYPE == 7:  # Q5_0, Q5_1: bit j of the block's word is value j's fifth
            word = tl.load(h_ptr + r2 * (K // 32) + g2, mask=mask2, other=0)[:, :, None]
            qlo |= ((word >> l) & 1) << 4
            qhi |= ((word >> (l + 16)) & 1) << 4
        if QTYPE == 13:  # Q5_K: bit t of byte j of a super-block's 32 is value 32t + j's fifth
            bits = tl.load(h_ptr + r3 * (K // 8) + (g3 // 8) * 32 + (g3 % 2) * 16 + l, mask=mask, other=0)
            shift = ((g3 % 8) // 2) * 2  # 2c
            qlo |= ((bits.to(tl.int32) >> shift) & 1) << 4
            qhi |= ((bits.to(tl.int32) >> (shift + 1)) & 1) << 4
        if QTYPE == 14:  # Q6_K: bits 2r, 2r + 1 of byte j of a half's 32 are value 32r + j's top two
            bits = tl.load(h_ptr + r3 * (K // 4) + (g3 // 4) * 32 + (g3 % 2) * 16 + l, mask=mask, other=0)
            shift = ((g3 % 4) // 2) * 2  # 2r for lo; hi is r + 2
            qlo |= ((bits.to(tl.int32) >> shift) & 3) << 4
            qhi |= ((bits.to(tl.int32) >> (shift + 4)) & 3) << 4
        if QTYPE == 2 or QTYPE == 6:  # Q4_0, Q5_0: (q - 8) * d, (q - 16) * d
            off: tl.constexpr = 8 if QTYPE == 2 else 16
            d = tl.load(d_ptr + r2 * (K // 32) + g2, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
            lo = (qlo - off).to(tl.float32) * d
            hi = (qhi - off).to(tl.float32) * d
        elif QTYPE == 3 or QTYPE == 7:  # Q4_1, Q5_1: d * q + m (d * q is exact: one rounding)
            d = tl.load(d_ptr + r2 * (K // 32) + g2, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
            m = tl.load(m_ptr + r2 * (K // 32) + g2, mask=mask2, other=0.0).to(tl.float32)[:, :, None]
            lo = d * qlo.to(tl.float32) + m
            hi = d * qhi.to(tl.float32) + m
        elif QTYPE == 14:  # Q6_K: (d * sc) * (q - 32), both products exact
            d = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0.0).to(tl.float32)
            sub = 8 * (g2 // 4) + g2 % 4
            sc_lo = tl.load(s_ptr + r2 * (K // 16) + sub, mask=mask2, other=0).to(tl.float32)
            sc_hi = tl.load(s_ptr + r2 * (K // 16) + sub + 4, mask=mask2, other=0).to(tl.float32)
            lo = (d * sc_lo)[:, :, None] * (qlo - 32).to(tl.float32)
            hi = (d * sc_hi)[:, :, None] * (qhi - 32).to(tl.float32)
        else:  # Q4_K, Q5_K: (d * sc) * q - dmin * mn, the products exact: one rounding
            d = tl.load(d_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0.0).to(tl.float32)
            dmin = tl.load(m_ptr + r2 * (K // 256) + g2 // 8, mask=mask2, other=0.0).to(tl.float32)
            sub = g2 - g2 % 2
            sc_lo = tl.load(s_ptr + r2 * (K // 32) + sub, mask=mask2, other=0).to(tl.float32)
            sc_hi = tl.load(s_ptr + r2 * (K // 32) + sub + 1, mask=mask2, other=0).to(tl.float32)
            mn_lo = tl.load(mn_ptr + r2 * (K // 32) + sub, mask=mask2, other=0).to(tl.float32)
            mn_hi = tl.load(mn_ptr + r2 * (K // 32) + sub + 1, mask=mask2, other=0).to(tl.float32)
            lo = (d * sc_lo)[:, :, None] * qlo.to(tl.float32) - (dmin * mn_lo)[:, :, None]
            hi = (d * sc_hi)[:, :, None] * qhi.to(tl.float32) - (dmin * mn_hi)[:, :, None]
    return lo, hi


@triton.jit
def _gguf_gemv_kernel(x_ptr, res_ptr, nw_ptr, q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, hout_ptr,
                      stride_x, stride_r, stride_y, stride_h, N, eps, K: tl.constexpr, QTYPE: tl.constexpr,
                      SPAN: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PROLOGUE: tl.constexpr,
                      HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr):
    # program (p, m): outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of row m, GROUPS groups (GROUPS x 32
    # values) a step along K; the rows of x (at most 4) read the same weight tiles, from L2 after the first
    pid = tl.program_id(0)
    m = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    inv = 0.0
    if PROLOGUE == 1:
        inv = tl.sum(inv_rms(x_ptr + m * stride_x, res_ptr + m * stride_r, tl.arange(0, 1), tl.full([1], True, tl.int1),
                             stride_x, stride_r, eps, K, 1, 512, HAS_RES), 0)
    l = tl.arange(0, 16)[None, :]
    acc = tl.zeros([BLOCK_N, GROUPS, 16], tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        gmask = g < K // 32
        lo, hi = _group_values(q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, n, nmask, g, gmask, K, QTYPE)
        cols = _columns(g, SPAN)[:, None] + l  # [GROUPS, 16]
        cmask = gmask[:, None]
        a_lo = prologue_input(x_ptr, res_ptr, nw_ptr, hout_ptr, m, cols, cmask, cmask, inv, pid == 0, stride_x,
                              stride_r, stride_h, K, PROLOGUE, HAS_RES)
        a_hi = prologue_input(x_ptr, res_ptr, nw_ptr, hout_ptr, m, cols + SPAN // 2, cmask, cmask, inv, pid == 0,
                              stride_x, stride_r, stride_h, K, PROLOGUE, HAS_RES)
        acc += a_lo[None, :, :] * lo + a_hi[None, :, :] * hi
    y = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y + n, y.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gguf_matmul_kernel(x_ptr, q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, M, N, stride_x, stride_y,
                        K: tl.constexpr, QTYPE: tl.constexpr, SPAN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUPS: tl.constexpr, GROUP_M: tl.constexpr):
    # tile (pid_m, pid_n) of y; each step dequantizes GROUPS groups of the weight's tile rows to x's
    # dtype and multiplies their lo and hi halves with x's matching columns on tensor cores
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = m < M
    nmask = n < N
    p = tl.arange(0, GROUPS * 16)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(0, K // 32, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        lo, hi = _group_values(q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, n, nmask, g, g < K // 32, K, QTYPE)
        gp = g0 + p // 16
        cols = _columns(gp, SPAN) + p % 16
        xmask = mmask[:, None] & (gp < K // 32)[None, :]
        a_lo = tl.load(x_rows + cols[None, :], mask=xmask, other=0.0)
        a_hi = tl.load(x_rows + (cols + SPAN // 2)[None, :], mask=xmask, other=0.0)
        w_lo = tl.reshape(lo, [BLOCK_N, GROUPS * 16]).to(a_lo.dtype)
        w_hi = tl.reshape(hi, [BLOCK_N, GROUPS * 16]).to(a_lo.dtype)
        acc = tl.dot(a_lo, tl.trans(w_lo), acc, input_precision=PRECISION)
        acc = tl.dot(a_hi, tl.trans(w_hi), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _gguf_rows_kernel(ids_ptr, q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, y_ptr, R, N, stride_y, K: tl.constexpr,
                      QTYPE: tl.constexpr, SPAN: tl.constexpr, BLOCK_R: tl.constexpr, GROUPS: tl.constexpr):
    # program (pid_r, pid_g): the values of groups [pid_g * GROUPS, ...) of rows ids[pid_r * BLOCK_R, ...)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    n = tl.load(ids_ptr + r, mask=rmask, other=0)
    nmask = rmask & (n >= 0) & (n < N)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    gmask = g < K // 32
    lo, hi = _group_values(q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, n, nmask, g, gmask, K, QTYPE)
    cols = (_columns(g, SPAN)[:, None] + tl.arange(0, 16)[None, :])[None, :, :]
    out = y_ptr + r.to(tl.int64)[:, None, None] * stride_y + cols
    mask = rmask[:, None, None] & gmask[None, :, None]
    tl.store(out, lo.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(out + SPAN // 2, hi.to(y_ptr.dtype.element_ty), mask=mask)


# ---- wrappers ----------------------------------------------------------------------------------------------------

Planes = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
               torch.Tensor | None]  # qs, qh, d, m, sc, mn (layers/quant/gguf_cuda.py's GGUFPlanes.kernel_args)


def _check(qtype: int, n: int, k: int, planes: Planes) -> None:
    if qtype not in SPANS:
        raise ValueError(f"no CUDA kernel for GGML type {qtype}: the kernels take {sorted(SPANS)}")
    values = 256 if qtype >= 12 else 32
    if k % values or planes[0].shape[0] != n or not planes[0].is_contiguous():
        raise ValueError(f"GGML type {qtype} planes of {n} rows of {k} values (a multiple of {values}), contiguous; "
                         f"got qs {tuple(planes[0].shape)}")


def _pointers(planes: Planes) -> list[torch.Tensor]:
    """The planes as kernel arguments: an absent one is qs (never read)."""
    return [p if p is not None else planes[0] for p in planes]


def gemv_config(n: int, fill_gpu: bool = True) -> tuple[int, int, int]:
    """(BLOCK_N, GROUPS, num_warps): a first guess for the H100 / H200, not yet measured: 8 rows of the
    weight a program and 32 groups (1024 values) a step, so x's tile (read from L2 by every program)
    is under half the weight bytes beside it; fewer rows when the output is short. On Triton's
    interpreter the fewest programs run fastest."""
    if not fill_gpu:
        return 32, 16, 4
    block_n = 8
    while block_n > 1 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, 32, 4


def gguf_gemv(x: torch.Tensor, qtype: int, planes: Planes, n: int, bias: torch.Tensor | None = None,
              prologue: str = "none", residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, config: tuple[int, ...] | None = None, per_value: bool = False):
    """x [M <= MAX_ROWS, K] ([M, 2K] for "silu") in a float dtype, contiguous rows, times the GGUF
    weight [n, K]^T (+ bias [n]) -> y [M, n] in x's dtype; with prologue "norm" returns (y, h), h =
    x + residual (a new tensor; x itself when residual is None), as kernels/gemv.py's gemv.
    The types of gguf_gemv.py's WORD_TYPES go to its word kernel (config: its (BLOCK_N, BLOCK_J,
    num_warps, num_stages)) unless per_value; the others, and those with per_value, to this
    file's per-value kernel (config: (BLOCK_N, GROUPS, num_warps))."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    rows = x.shape[0]
    k = x.shape[-1] // 2 if prologue == "silu" else x.shape[-1]
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [M, K] float with contiguous rows; got {x.dtype} {tuple(x.shape)}")
    check_gemv_args(x, n, k, bias, prologue, residual, norm_weight, MAX_ROWS, "the GGUF GEMV", "gguf_matmul")
    _check(qtype, n, k, planes)
    if qtype in WORD_TYPES and not per_value:
        return gguf_word_gemv(x, qtype, planes, n, bias, prologue, residual, norm_weight, eps, config)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    block_n, groups, warps = config or gemv_config(n, x.is_cuda)
    _gguf_gemv_kernel[(triton.cdiv(n, block_n), rows)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, *_pointers(planes),
        bias if bias is not None else x, y, h, x.stride(0), residual.stride(0) if residual is not None else 0,
        y.stride(0), h.stride(0), n, eps, K=k, QTYPE=qtype, SPAN=SPANS[qtype], BLOCK_N=block_n, GROUPS=groups,
        PROLOGUE=PROLOGUES[prologue], HAS_RES=residual is not None, HAS_BIAS=bias is not None, num_warps=warps)
    return (y, h) if prologue == "norm" else y


def matmul_config(rows: int, on_gpu: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUPS, num_warps, num_stages): row tiles from 16 to 128 as M grows, 128
    values of K a step (GROUPS 4: two dots of 64). A first guess, as kernels/wna16.py's. On Triton's
    interpreter the fewest programs run fastest."""
    if not on_gpu:
        return min(64, max(16, triton.next_power_of_2(rows))), 256, 16, 4, 1
    block_m = min(128, max(16, triton.next_power_of_2(rows)))
    return block_m, 128 if block_m >= 64 else 64, 4, 4 if block_m <= 64 else 8, 3


def gguf_matmul(x: torch.Tensor, qtype: int, planes: Planes, n: int, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16, float16 or float32, contiguous rows) times the GGUF weight [n, K]^T (+ bias
    [n]) -> y [M, n] in x's dtype; the weight rounded once to x's dtype on its way to the tensor cores
    (float32 x: IEEE float32 products, no TF32)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [M, K] float with contiguous rows; got {x.dtype} {tuple(x.shape)}")
    rows, k = x.shape
    _check(qtype, n, k, planes)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    block_m, block_n, groups, warps, stages = config or matmul_config(rows, x.is_cuda)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _gguf_matmul_kernel[grid](
        x, *_pointers(planes), bias if bias is not None else x, y, rows, n, x.stride(0), y.stride(0), K=k, QTYPE=qtype,
        SPAN=SPANS[qtype], HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, GROUPS=groups, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y


def gguf_rows(ids: torch.Tensor, qtype: int, planes: Planes, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (any shape, integer, each in [0, n)) of the GGUF weight [n, k], dequantized to
    dtype: [*ids.shape, k] (an embedding lookup; an id outside [0, n) gives a row of zeros)."""
    _check(qtype, n, k, planes)
    flat = ids.reshape(-1)
    y = torch.empty(flat.shape[0], k, dtype=dtype, device=planes[0].device)
    if flat.shape[0] == 0:
        return y.view(*ids.shape, k)
    block_r, groups = (4, 32) if planes[0].is_cuda else (16, 16)
    grid = (triton.cdiv(flat.shape[0], block_r), triton.cdiv(k // 32, groups))
    _gguf_rows_kernel[grid](flat, *_pointers(planes), y, flat.shape[0], n, y.stride(0), K=k, QTYPE=qtype,
                            SPAN=SPANS[qtype], BLOCK_R=block_r, GROUPS=groups, num_warps=4)
    return y.view(*ids.shape, k)
