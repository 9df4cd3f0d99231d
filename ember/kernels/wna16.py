"""The matmul of float activations and 4- or 8-bit integer weights (W4A16, W8A16: AWQ, GPTQ
and compressed-tensors checkpoints, read into one layout by layers/quant/int_weight.py),
dequantized in registers, on tensor cores (tl.dot); a few rows take the GEMV of
kernels/int_gemv.py instead.

    qweight  int32 [N, ceil(K / PER)]   PER = 32 / BITS values a word, value k at bits (k % PER) * BITS
    scales   [N, G] float               zeros uint8 [N, G] (none: 2^(BITS - 1))
    g_idx    int32 [K] (none: k // GROUP)
    W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

Tile (pid_m, pid_n) of y [M, N], K in steps of BLOCK_K, one float32 accumulator:

    acc = dot(x[m, k0:k0 + BLOCK_K], W[n, k0:k0 + BLOCK_K]^T, acc)

with the weight tile dequantized in registers and rounded once to x's dtype (exact for float32
x and 16-bit scales: (q - z) * s has at most 20 significant bits), as Marlin-style kernels do:

    grouped (BLOCK_K divides GROUP, or one group a row): a tile's columns share group g, so a
        scale and a zero a row, and each word, read once as [BLOCK_N, BLOCK_K / PER], is
        unpacked in place by the thread holding it (dequantize_words: an AND, a subtraction
        and a multiplication a value, the float 2^23 trick of kernels/int_gemv.py, no int ->
        float conversion; tl.join keeps a word's values with it);
    per column (act-order g_idx, or a group no power-of-two tile of 16+ divides): each column's
        scale and zero gathered ([BLOCK_N, BLOCK_K] loads), the words repeated PER times.

Scaling after the dot (acc += dot(x, (q - z)^T) * s, the weight never rounded) needs a second
[BLOCK_M, BLOCK_N] float32 tile: at 128 x 128 and 8 warps that is 255 registers a thread and
spills (sm_90), one program an SM, and the wgmma still waits each step; with one accumulator
the tile takes 128 registers, and two programs share an SM. sm_90 SASS counts of the loop
(instructions a weight value a thread, AWQ, K = 4096): 6.6 to 8.4 grouped at wna16_config's
tiles, 22 to 24 per column, no spills (tests/kernels/test_wna16_kernels.py compiles them).

float32 activations multiply in IEEE float32 (no TF32). Allocates by shape alone and never
syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.tiles import grouped_tile

SMS = 132  # the H100's streaming multiprocessors: wna16_config fills them
# (rows padded to a power of two, N, K) -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for 4-bit
# weights: the MATMUL_TUNED dict of benchmarks/scripts/int4_gemv_bench.py --sweep --write, measured on the
# H100 (2026-12-06; 512 and 2048 rows)
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (512, 4096, 4096): (128, 64, 64, 4, 4),
    (512, 4096, 14336): (128, 64, 64, 4, 4),
    (512, 6144, 4096): (128, 128, 64, 8, 3),
    (512, 28672, 4096): (128, 128, 64, 8, 3),
    (2048, 4096, 4096): (128, 128, 64, 8, 3),
    (2048, 4096, 14336): (128, 128, 64, 8, 4),
    (2048, 6144, 4096): (128, 128, 64, 8, 3),
    (2048, 28672, 4096): (128, 128, 64, 8, 3),
}


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
def _scaled_values(half, z, s, BITS: tl.constexpr, I: tl.constexpr):
    """(q - z) * s for the values at bits shift = I * BITS of each half word (`half`, under the float
    2^23's exponent bits 0x4B000000): one AND leaves the float 2^23 + q 2^shift (q 2^shift < 2^16),
    minus 2^23 + z 2^shift it is (q - z) 2^shift exactly, times s 2^-shift."""
    f = (half & (0x4B000000 | (((1 << BITS) - 1) << (I * BITS)))).to(tl.float32, bitcast=True)
    return (f - (z * (1 << (I * BITS)) + 8388608.0)) * (s * (1.0 / (1 << (I * BITS))))


@triton.jit
def dequantize_words(words, z, s, BITS: tl.constexpr):
    """W = (q - z) * s in float32 of int32 words [R, J] -> [R, J, PER]: each word's values in K
    order, kept by the thread that holds the word (reshape to [R, J * PER]); z and s float32,
    broadcast to [R, J]."""
    low = words | 0x4B000000
    high = (words >> 16) | 0x4B000000  # the sign bits shifted in are masked off
    # tl.join's new dim is the last: the innermost join picks the high bit of the value's index
    if BITS == 4:
        return tl.join(tl.join(tl.join(_scaled_values(low, z, s, BITS, 0), _scaled_values(high, z, s, BITS, 0)),
                               tl.join(_scaled_values(low, z, s, BITS, 2), _scaled_values(high, z, s, BITS, 2))),
                       tl.join(tl.join(_scaled_values(low, z, s, BITS, 1), _scaled_values(high, z, s, BITS, 1)),
                               tl.join(_scaled_values(low, z, s, BITS, 3), _scaled_values(high, z, s, BITS, 3))))
    else:
        return tl.join(tl.join(_scaled_values(low, z, s, BITS, 0), _scaled_values(high, z, s, BITS, 0)),
                       tl.join(_scaled_values(low, z, s, BITS, 1), _scaled_values(high, z, s, BITS, 1)))


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
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = (K + PER - 1) // PER
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
        if GROUPED:  # the tile lies in one group: a scale and a zero a row
            j = k0 // PER + tl.arange(0, BLOCK_K // PER)
            words = tl.load(w_ptr + n[:, None] * stride_w + j[None, :], mask=nmask[:, None] & (j < WORDS)[None, :],
                            other=0)
            g = k0 // GROUP
            s = tl.load(s_ptr + n * stride_s + g, mask=nmask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + n * stride_z + g, mask=nmask, other=0).to(tl.float32)
            else:
                z = tl.full([BLOCK_N], 1 << (BITS - 1), tl.float32)
            w = tl.reshape(dequantize_words(words, z[:, None], s[:, None], BITS), [BLOCK_N, BLOCK_K])
        else:
            w = unpack_tile(w_ptr, s_ptr, z_ptr, g_ptr, n, nmask, k0, stride_w, stride_s, stride_z, K, BITS, GROUP,
                            HAS_ZEROS, HAS_G_IDX, BLOCK_N, BLOCK_K)
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def wna16_config(rows: int, n: int, k: int, bits: int = 4, on_gpu: bool = True) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for x [rows, k] times a weight [n, k]:
    TUNED's entry for the rows (padded to a power of two) and shape where it has one. Otherwise
    reasoned from the sm_90 SASS (registers, spills, instructions a weight value; tests/kernels/
    test_wna16_kernels.py compiles each) for the shapes and rows the sweep did not time. Up to 64 rows (the weight's bytes bound the
    time) one row tile, 64 weight rows a program and 128 values of K a step, 4 warps, 4 stages;
    at 16 rows 32 weight rows a program where 64 would leave under two programs an SM of the
    H100 (132). More rows: 128 x 128 tiles, 64 of K a step, 8 warps (wgmma by two warp groups;
    128 registers a thread, so two programs share an SM and one dequantizes while the other's
    wgmma runs), 128 x 64 with 4 warps where 128 x 128 would leave under two programs an SM.
    On Triton's interpreter (on_gpu False) the fewest programs and steps of K run fastest (the
    tests' time goes to each step's dequantization): 128 weight rows a program and 128 of K a step
    (the GPU's step up to 64 rows), the row tiles of 16 and 32 kept."""
    if not on_gpu:
        return (16 if rows <= 16 else 32), 128, 128, 4, 1
    m_pad = max(16, triton.next_power_of_2(rows))
    if bits == 4 and (m_pad, n, k) in TUNED:
        return TUNED[m_pad, n, k]
    if m_pad <= 64:
        return m_pad, 32 if m_pad == 16 and triton.cdiv(n, 64) < 2 * SMS else 64, 128, 4, 4
    if triton.cdiv(rows, 128) * triton.cdiv(n, 128) < 2 * SMS:
        return 128, 64, 64, 4, 4
    return 128, 128, 64, 8, 4


def matmul_path(group_size: int, k: int, has_g_idx: bool, block_k: int) -> tuple[bool, int]:
    """(grouped, BLOCK_K) of the kernel for the weight's groups and the config's BLOCK_K: grouped
    where a power-of-two tile of at least 32 lies inside one group (BLOCK_K shrinks to it), or
    one group spans the row; otherwise per column, at most 64 of K a step (its scales and zeros
    are [BLOCK_N, BLOCK_K] tensors: at 128 they spill at 64 x 64). Not 16: groups of 48 through
    the grouped tile of 16 (two words a row) gave wrong bfloat16 products on the H100 (right on
    the interpreter and in float32)."""
    if not has_g_idx and group_size >= k:
        return True, block_k
    divides = group_size & -group_size  # the largest power of two dividing the group size
    if not has_g_idx and divides >= 32:
        return True, min(block_k, divides)
    return False, min(block_k, 64)


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
    block_m, block_n, block_k, warps, stages = config or wna16_config(rows, n, k, bits, x.is_cuda)
    single = g_idx is None and group_size >= k  # one group a row
    grouped, block_k = matmul_path(group_size, k, g_idx is not None, block_k)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
    _wna16_matmul_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else qweight,
        bias if bias is not None else scales, y, rows, n, x.stride(0), qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, y.stride(0), K=k, BITS=bits, GROUP=k if single else group_size,
        GROUPED=grouped, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
