"""The GEMV of 4- and 8-bit integer weights (W4A16, W8A16: kernels/wna16.py's layout) for a few
rows (decode), word by word, with kernels/gemv.py's prologues fused in:

    y[m, n] = sum_g s[n, g] * sum_{k in g} a[m, k] * (q[n, k] - z[n, g])

Program p owns outputs [p * BLOCK_N, (p + 1) * BLOCK_N) and streams those rows of qweight in
tiles of BLOCK_J int32 words a row, seen as [CHUNKS, BLOCK_N, CHUNK]: CHUNK consecutive words
lie in one group, so a scale and a zero are loaded once a chunk, never once a value. Each word
is read once (software-pipelined STAGES deep) and its PER = 32 / BITS values taken one bit
position i at a time, each against x at columns word * PER + i:

    v_i  = half & (0x4B000000 | (2^BITS - 1) << shift)   value i in place at bit `shift` of its
                                                         16-bit half, under the exponent bits of
                                                         the float 2^23: it is 2^23 + q 2^shift
    part += a_i 2^-shift * (v_i - (2^23 + z 2^shift))    (q - z) 2^shift, exact: no shift and no
                                                         int -> float conversion a value
    acc  += part * s                                     once a word, after its PER values

so a value costs an AND, a subtraction and an FMA a row. x's tile ([M, BLOCK_J * PER], the
prologue applied and scaled by 2^-shift) is computed once a program and split (tl.split) into
one tensor a bit position, which Triton moves into the weight's layout through shared memory
(two barriers each); a thread computing the x values it needs itself would repeat the
prologue for every thread that shares them. The accumulator keeps float32 partial sums
[M, CHUNKS, BLOCK_N, CHUNK], summed once at the end. Zero points (uint8, which cp.async does
not take) are loaded a tile ahead: the values' loop needs them first thing, where a load of
the tile's own (issued once the tile's words are in) would stall it; the scales, needed last,
do not. At one row ptxas's registers are capped
(int_gemv_registers) so that the kernel with zero points fits as many programs an SM as the
symmetric one. In the sm_90 SASS at one row (16 x 256
words, 8 warps) the loop takes ~4.7 instructions and 0.125 barriers a value, with the norm or
SiLU prologue ~5.7; gemv.py's per-value path at its tile (8 x 1024 values, 4 warps) ~7.6
instructions and 0.5 barriers.

It takes weights whose groups hold whole words (group_size a multiple of PER, or one group a
row) in K order, or sorted so by group (an act-order weight whose groups each hold group_size
columns: IntWeight sorts it at load, and x's tile is read through the permutation); other
act-order weights (g_idx) and groups that cut a word go to gemv.py's kernel, which dequantizes
each value with its own group's scale (int_gemv does the choosing).
Allocates by shape alone and never syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.gemv import PROLOGUES, check_gemv_args, gemv, inv_rms, prologue_input
from ember.kernels.wna16 import check_int_weight

MAX_ROWS = 8  # the word kernel's rows (the layers send up to kernel_paths.INT_GEMV_MAX_ROWS)
REGISTERS_AN_SM = 65536  # sm_80 / sm_90
PROGRAMS_AN_SM = 3  # at one row (int_gemv_registers)
# (rows, N, K) -> (BLOCK_N, BLOCK_J, num_warps, num_stages) for 4-bit weights: the TUNED dict that
# benchmarks/scripts/int4_gemv_bench.py --sweep --write measured on the H100 (2026-12-06, AWQ-style layers)
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (1, 4096, 4096): (8, 512, 8, 3),
    (1, 4096, 14336): (8, 256, 8, 3),
    (1, 6144, 4096): (8, 512, 8, 3),
    (1, 28672, 4096): (8, 512, 8, 3),
    (2, 4096, 4096): (16, 128, 8, 3),
    (2, 4096, 14336): (16, 128, 8, 3),
    (2, 6144, 4096): (8, 128, 4, 3),
    (2, 28672, 4096): (32, 64, 8, 3),
    (4, 4096, 4096): (16, 64, 8, 3),
    (4, 4096, 14336): (16, 64, 8, 3),
    (4, 6144, 4096): (32, 32, 8, 3),
    (4, 28672, 4096): (32, 32, 8, 3),
    (8, 4096, 4096): (16, 32, 8, 3),
    (8, 4096, 14336): (16, 32, 8, 4),
    (8, 6144, 4096): (16, 32, 8, 3),
    (8, 28672, 4096): (16, 32, 8, 3),
}


@triton.jit
def _values_dot(part, a, half, z, BITS: tl.constexpr, I: tl.constexpr):
    """part + a * (q - z) 2^shift for the values at bits shift = I * BITS of each half word (`half`,
    under 2^23's exponent bits: one AND leaves the float 2^23 + q 2^shift, q 2^shift < 2^16, and
    minus 2^23 + z 2^shift it is (q - z) 2^shift exactly); a [M_PAD, CHUNKS, CHUNK] holds x 2^-shift."""
    f = (half & (0x4B000000 | (((1 << BITS) - 1) << (I * BITS)))).to(tl.float32, bitcast=True)
    return part + a[:, :, None, :] * (f - (z * (1 << (I * BITS)) + 8388608.0))


@triton.jit
def _int_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, z_ptr, p_ptr, b_ptr, y_ptr, h_ptr, stride_x, stride_r, stride_w,
                     stride_s, stride_z, stride_y, stride_h, N, eps, M: tl.constexpr, M_PAD: tl.constexpr,
                     K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, CHUNK: tl.constexpr, PROLOGUE: tl.constexpr,
                     HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr, STAGES: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = (K + PER - 1) // PER
    CHUNKS: tl.constexpr = BLOCK_J // CHUNK
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, M_PAD)
    mmask = m < M
    # the weight's tensors are [1, CHUNKS, BLOCK_N, CHUNK] or broadcast to it
    n4 = n[None, None, :, None]
    nmask4 = nmask[None, None, :, None]
    first = (tl.arange(0, CHUNKS) * CHUNK)[None, :, None, None]  # each chunk's first word in the tile
    # the zero points a tile ahead: the values' loop needs them first thing, where a load of the
    # tile's own would stall it (cp.async, which pipelines the words, takes no single bytes)
    z_next = tl.load(z_ptr + n4 * stride_z + first * PER // GROUP, mask=nmask4 & (first < WORDS), other=0) \
        if HAS_ZEROS else 0
    inv = tl.zeros([M_PAD], tl.float32)
    if PROLOGUE == 1:
        inv = inv_rms(x_ptr, res_ptr, m, mmask, stride_x, stride_r, eps, K, M_PAD, 2048 // M_PAD, HAS_RES)
    word = first + tl.arange(0, CHUNK)[None, None, None, :]
    # x's columns in a tile, and 2^-shift of each (_values_dot)
    kk = tl.arange(0, BLOCK_J * PER)
    unshift = 1.0 / (1 << (BITS * ((kk % PER) % (PER // 2))))
    acc = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
    for j0 in tl.range(0, WORDS, BLOCK_J, num_stages=STAGES):
        j = j0 + word
        words = tl.load(w_ptr + n4 * stride_w + j, mask=nmask4 & (j < WORDS), other=0)
        g = (j0 + first) * PER // GROUP
        gmask = nmask4 & (j0 + first < WORDS)
        s = tl.load(s_ptr + n4 * stride_s + g, mask=gmask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = z_next.to(tl.float32)
            ahead = j0 + BLOCK_J + first
            z_next = tl.load(z_ptr + n4 * stride_z + ahead * PER // GROUP, mask=nmask4 & (ahead < WORDS), other=0)
        else:
            z = tl.full([1, CHUNKS, BLOCK_N, 1], 1 << (BITS - 1), tl.float32)
        # the tile's x, computed once: [M_PAD, BLOCK_J * PER] -> [M_PAD, CHUNKS, CHUNK, PER]
        col = j0 * PER + kk
        kmask = col < K
        if HAS_PERM:  # the weight's columns sorted by group: x's column of each
            col = tl.load(p_ptr + col, mask=kmask, other=0)
        cmask = kmask[None, :]
        a = prologue_input(x_ptr, res_ptr, nw_ptr, h_ptr, m[:, None], col[None, :], mmask[:, None] & cmask, cmask,
                           inv[:, None], pid == 0, stride_x, stride_r, stride_h, K, PROLOGUE, HAS_RES)
        a = tl.reshape(a * unshift[None, :], [M_PAD, CHUNKS, CHUNK, PER // 2, 2])
        even, odd = tl.split(a)
        # each half word's values at bits 0..15, under the float 2^23's exponent bits (0x4B000000)
        low = words | 0x4B000000
        high = (words >> 16) | 0x4B000000
        part = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
        if PER == 8:
            a04, a26 = tl.split(tl.reshape(even, [M_PAD, CHUNKS, CHUNK, 2, 2]))
            a15, a37 = tl.split(tl.reshape(odd, [M_PAD, CHUNKS, CHUNK, 2, 2]))
            a0, a4 = tl.split(a04)
            a2, a6 = tl.split(a26)
            a1, a5 = tl.split(a15)
            a3, a7 = tl.split(a37)
            part = _values_dot(part, a0, low, z, BITS, 0)
            part = _values_dot(part, a1, low, z, BITS, 1)
            part = _values_dot(part, a2, low, z, BITS, 2)
            part = _values_dot(part, a3, low, z, BITS, 3)
            part = _values_dot(part, a4, high, z, BITS, 0)
            part = _values_dot(part, a5, high, z, BITS, 1)
            part = _values_dot(part, a6, high, z, BITS, 2)
            part = _values_dot(part, a7, high, z, BITS, 3)
        else:
            a0, a2 = tl.split(even)
            a1, a3 = tl.split(odd)
            part = _values_dot(part, a0, low, z, BITS, 0)
            part = _values_dot(part, a1, low, z, BITS, 1)
            part = _values_dot(part, a2, high, z, BITS, 0)
            part = _values_dot(part, a3, high, z, BITS, 1)
        acc += part * s
    y = tl.sum(tl.sum(acc, 3), 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def words_kernel_takes(bits: int, group_size: int, k: int, g_idx: torch.Tensor | None) -> bool:
    """Whether the word kernel takes this weight: groups of whole words in K order (or one group a row)."""
    return g_idx is None and (group_size >= k or group_size % (32 // bits) == 0)


def int_gemv_config(rows: int, n: int, k: int, bits: int, fill_gpu: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_J words, num_warps, num_stages): TUNED's entry for the rows (padded to a
    power of two) and shape where it has one (the H100's sweep: 8 rows of W and 256 words a step
    at one row). Otherwise reasoned from the sm_90 SASS, for shapes the sweep did not time. One
    row: 16 rows of W a program, 256 words (2048 4-bit values) a step, 8 warps, 3 stages in
    flight (16 KB of weight a stage; 128 registers a thread, two programs an SM); fewer rows a
    program (down to 4, and warps with them: 16 words a thread) while that leaves under two
    programs an SM of the H100 (132), as at N = 4096. More rows: BLOCK_J halves as rows double, so the [rows, BLOCK_N, BLOCK_J] float32
    accumulator and its partial sum keep to the registers. On Triton's interpreter (fill_gpu
    False) the fewest programs run fastest (each costs the interpreter's tile setup, whatever its
    size): half of N, a power of two, at least 16 rows of W a program, so that still two or more
    programs run, the last one masked where N is no power of two, as on the GPU."""
    words = triton.next_power_of_2(triton.cdiv(k, 32 // bits))
    m_pad = triton.next_power_of_2(rows)
    if not fill_gpu:
        return max(16, triton.next_power_of_2(n) // 2), min(64, words), 4, 1
    if bits == 4 and (m_pad, n, k) in TUNED:
        return TUNED[m_pad, n, k]
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, min(256 // m_pad, words), block_n // 2, 3


def int_gemv_registers(rows: int, warps: int, bits: int, perm: bool = False) -> int | None:
    """ptxas's register cap a thread (maxnreg) for the word GEMV: at one row of 4-bit weights,
    what lets PROGRAMS_AN_SM programs of `warps` warps share an SM's 64 K registers (80 at 8
    warps); None (no cap) at more rows, for 8-bit weights, through a permutation (`perm`), or
    where the cap would exceed the 255 a thread has anyway. Left to itself ptxas gave the kernel with zero points and the norm
    prologue (AWQ's q|k|v and gate|up) 96 registers at the one-row tiles, two programs an SM,
    where the symmetric kernel (GPTQ's) took 79 and three; capped, both take three, without a
    spill (the sm_90 SASS, tests/kernels/test_wna16_kernels.py). At two rows, at 8 bits, and
    through a permutation with zero points and the norm, the cap would spill: not set there."""
    if triton.next_power_of_2(rows) != 1 or bits != 4 or perm:
        return None
    cap = REGISTERS_AN_SM // (PROGRAMS_AN_SM * warps * 32) // 8 * 8  # ptxas allocates 8 registers at a time
    return cap if cap < 255 else None


def int_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             g_idx: torch.Tensor | None, bits: int, group_size: int, bias: torch.Tensor | None = None,
             prologue: str = "none", residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, perm: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None):
    """x [M <= MAX_ROWS, K] ([M, 2K] for "silu") in a float dtype with contiguous rows, times the
    integer weight [N, K]^T (+ bias [N]) -> y [M, N] in x's dtype; with prologue "norm" returns
    (y, h), h = x + residual (a new tensor; x itself when residual is None), as gemv.py's gemv.
    `perm` int32 [K]: the weight's column j multiplies the prologue's column perm[j] (an act-order
    weight sorted by group at load, IntWeight). The word kernel where it takes the weight
    (words_kernel_takes), else gemv.py's kernel (up to its MAX_ROWS rows, no perm)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {sorted(PROLOGUES)}, got {prologue!r}")
    k = x.shape[-1] // 2 if prologue == "silu" else x.shape[-1]
    if not words_kernel_takes(bits, group_size, k, g_idx):
        if perm is not None:
            raise ValueError("perm goes with weights the word kernel takes (groups of whole words, no g_idx)")
        return gemv(x, qweight, bias, prologue, residual, norm_weight, eps, weight_scale=scales, weight_zeros=zeros,
                    g_idx=g_idx, bits=bits, group_size=group_size)
    width = 2 * k if prologue == "silu" else k
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1 \
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [M, {width}] float with contiguous rows; got {x.dtype} {tuple(x.shape)} "
                         f"strides {x.stride()}")
    check_int_weight(qweight, scales, zeros, g_idx, bits, group_size, k)
    n = qweight.shape[0]
    check_gemv_args(x, n, k, bias, prologue, residual, norm_weight, MAX_ROWS, "the integer GEMV", "wna16_matmul")
    if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm must be int32 [{k}]; got {perm.dtype} {tuple(perm.shape)}")
    rows = x.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    block_n, block_j, warps, stages = config or int_gemv_config(rows, n, k, bits, x.is_cuda)
    single = group_size >= k
    group_words = group_size // (32 // bits)
    chunk = block_j if single else min(block_j, group_words & -group_words)  # a power of two dividing a group
    _int_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, qweight, scales,
        zeros if zeros is not None else scales, perm if perm is not None else qweight,
        bias if bias is not None else scales, y, h, x.stride(0),
        residual.stride(0) if residual is not None else 0, qweight.stride(0), scales.stride(0),
        zeros.stride(0) if zeros is not None else 0, y.stride(0), h.stride(0), n, eps, M=rows,
        M_PAD=triton.next_power_of_2(rows), K=k, BITS=bits, GROUP=k if single else group_size,
        HAS_ZEROS=zeros is not None, BLOCK_N=block_n, BLOCK_J=block_j, CHUNK=chunk, PROLOGUE=PROLOGUES[prologue],
        HAS_RES=residual is not None, HAS_BIAS=bias is not None, HAS_PERM=perm is not None, STAGES=stages,
        num_warps=warps, maxnreg=int_gemv_registers(rows, warps, bits, perm is not None))
    return (y, h) if prologue == "norm" else y
