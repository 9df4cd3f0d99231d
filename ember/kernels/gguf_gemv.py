"""The GEMV of GGUF Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights (a Q4_K_M file's types; the default
model's Q4_1 layers and Q8_0 embedding / tied LM head) for a few rows (decode), word by word,
with kernels/gemv.py's prologues fused in.
kernels/gguf.py holds the planes' layout (layers/quant/gguf_cuda.py splits the file's bytes)
and the per-value GEMV the other types take; gguf.py's gguf_gemv chooses.

Program p owns outputs [p * BLOCK_N, (p + 1) * BLOCK_N) of every row of x (up to 4: the weight
is read once for all of them) and streams those rows of the weight in tiles of BLOCK_J int32
words a row, seen as [CHUNKS, BLOCK_N, CHUNK]: a chunk is the words that share their scales.
Each word is read once and its values taken in place with kernels/int_gemv.py's float trick
(an AND leaves the float 2^23 + q 2^shift; minus 2^23 + z 2^shift it is (q - z) 2^shift, exact),
against x at their columns times 2^-shift. The scales multiply a chunk's partial sum once,
the minimums the sum of x over their sub-block (the dot factored):

    type  word (chunk)                     a chunk's sum
    Q4_0  qs: 8 nibbles (4 words: a block)  d * sum x (q - 8)
    Q4_1  qs: 8 nibbles (4 words: a block)  d * sum x q + m * sum x
    Q8_0  qs: 4 int8 (8 words: a block;     d * sum x q (q + 128: the byte with its top bit flipped)
          2 rows and up: 4)
    Q4_K  qs: 8 nibbles (8 words: 64        d sc_lo * sum_lo x q + d sc_hi * sum_hi x q
          values, sub-blocks lo and hi)       - dmin mn_lo * sum_lo x - dmin mn_hi * sum_hi x
    Q6_K  qh: 4 bytes of 2-bit pairs, with   sum over i < 4 of d sc_i * sum_i x (q - 32)
          the 2 words of ql they complete
          (4 qh words: 4 scales of 16)

A qs word's nibble p (bits 4p) is byte p // 2's low (p even) or high nibble, which a type's
layout puts at column  SPAN * (w // (SPAN / 8)) + 4 * (w % (SPAN / 8)) + p // 2 + SPAN / 2 * (p % 2)
of word w (SPAN 32: Q4_0, Q4_1; 64: Q4_K, whose lo nibbles are sub-block 2c and hi 2c + 1 of
chunk c). Q6_K's qh word u (super-block s, half h = u % 16 // 8, bytes j = 4 (u % 8) + b) holds
the top two bits of four values of each ql byte pair: ql words a = 32 s + 16 h + u % 8 and a + 8
give, a byte each,

    v0 = a & 0x0F0F0F0F | (qh << 4) & 0x30303030      value 256 s + 128 h + j       scale 2 i = 0
    v1 = (a + 8) & 0x0F0F0F0F | (qh << 2) & 0x30303030       ... + 32                    ... + 2
    v2 = a >> 4 & 0x0F0F0F0F | qh & 0x30303030               ... + 64                    ... + 4
    v3 = (a + 8) >> 4 & 0x0F0F0F0F | qh >> 2 & 0x30303030    ... + 96                    ... + 6

the 6-bit values in place at bits 8b (scale index 16 s + 8 h + (u % 8) // 4 + 2 i).

The numbers: every product and sum is float32 and each value's q - z exact, but the dot is
factored (the scales multiply sums of x q, the minimums sums of x), so y is not the float32
matmul over ggml's decoded weight (each value d sc q - dmin mn rounded once) bit for bit: it
is within a few float32 roundings of sum_k |x_k| (|d sc q_k| + |dmin mn|) of it. The tests
hold each output to |y - x w| <= 2^-20 sum_k |x_k| |w_k| against the exact dot (random bytes,
whose terms cancel, and quantized weights: ~2^-24 seen), and greedy decoding to the CPU's
tokens as before (tests/models/test_cuda_gguf.py, on the GPU).

x's tile (the prologue applied, times 2^-shift) is computed once a program in its own layout
(_in_shared: else Triton converts it in the weight's, once a weight row a thread holds) and
split into one tensor a value position, which Triton moves into the weight's layout through
shared memory, as int_gemv's. In the sm_90 SASS (benchmarks/scripts/gguf_gemv_sass.py: N = K
= 4096, the tiles the config functions pick, no prologue), instructions and barriers a weight
value in the main loop (all rows' work; the per-value kernel of gguf.py runs a program a row
of x, so its 4 rows cost 4 times its one), no spills, shared memory within the H100's:

    type  rows   per-value (8 x 1024, 4 warps)   word kernel (tile)
    Q4_0  1       8.81 ins  0.16 bar              4.55 ins  0.03 bar  (8, 256 words, 4, 3)
    Q4_0  4      35.25      0.63                 10.69      0.13      (8, 64, 4, 3)
    Q4_1  1       8.05      0.19                  5.30      0.09
    Q4_1  4      32.19      0.75                 14.91      0.38
    Q8_0  1       6.62      0.16                  5.62      0.15      (8, 512, 4, 3)
    Q8_0  4      26.50      0.63                 12.06      0.34      (8, 128, 4, 3)
    Q4_K  1       8.81      0.13                  5.77      0.09      (8, 256, 4, 3)
    Q4_K  4      35.25      0.50                 14.69      0.19      (8, 64, 4, 3)
    Q6_K  1      13.55      0.22                  5.91      0.05      (8, 128 qh words, 4, 3)
    Q6_K  4      54.19      0.88                 13.19      0.19      (8, 32, 4, 3)

(16 rows a program and 8 warps, as N = 6144 and up get: Q4_0 4.35, Q4_K 5.43, Q6_K 5.70 at one
row.) The norm prologue adds ~0.7 at one row. Left on the table: the sums of x for the
minimums (Q4_1, Q4_K: ~4 instructions a value at 4 rows, through shared memory and shuffles;
a pass of their own after the loop cost more at one row: Q4_K 6.33 and 15.38 in all); Q8_0's
chunk of 8 words (a block) at 4 rows took 13.34 and 1.09 barriers a value; reading x in column order and permuting it cut Q4_K's count ~3%
but doubled its barriers, so x is read in the words' order. Allocates by shape alone and
never syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.gemv import PROLOGUES, inv_rms, prologue_input
from ember.kernels.int_gemv import _values_dot

WORD_TYPES = (2, 3, 8, 12, 14)  # Q4_0, Q4_1, Q8_0, Q4_K, Q6_K
MAX_ROWS = 4
# (qtype, rows padded to a power of two, N, K) -> (BLOCK_N, BLOCK_J, num_warps, num_stages): the TUNED
# dict benchmarks/scripts/gguf_gemv_bench.py --sweep --write measured on the H100 (2026-12-06)
TUNED: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {
    (3, 1, 4096, 4096): (8, 512, 8, 3),
    (3, 1, 4096, 14336): (4, 256, 2, 3),
    (3, 1, 6144, 4096): (8, 512, 8, 3),
    (3, 1, 28672, 4096): (8, 512, 8, 3),
    (3, 2, 4096, 4096): (4, 128, 2, 3),
    (3, 2, 4096, 14336): (4, 128, 2, 3),
    (3, 2, 6144, 4096): (16, 64, 4, 3),
    (3, 2, 28672, 4096): (16, 64, 4, 3),
    (3, 4, 4096, 4096): (16, 32, 4, 3),
    (3, 4, 4096, 14336): (16, 32, 4, 3),
    (3, 4, 6144, 4096): (16, 32, 4, 3),
    (3, 4, 28672, 4096): (16, 32, 4, 3),
    (12, 1, 4096, 4096): (8, 512, 8, 3),
    (12, 1, 4096, 14336): (8, 256, 4, 3),
    (12, 1, 6144, 4096): (8, 512, 8, 3),
    (12, 1, 28672, 4096): (8, 512, 8, 3),
    (12, 2, 4096, 4096): (8, 128, 4, 3),
    (12, 2, 4096, 14336): (8, 128, 4, 3),
    (12, 2, 6144, 4096): (16, 64, 4, 3),
    (12, 2, 28672, 4096): (32, 64, 8, 3),
    (12, 4, 4096, 4096): (16, 64, 8, 2),
    (12, 4, 4096, 14336): (16, 64, 8, 2),
    (12, 4, 6144, 4096): (16, 32, 4, 3),
    (12, 4, 28672, 4096): (16, 32, 4, 3),
    (14, 1, 4096, 4096): (8, 256, 8, 3),
    (14, 1, 4096, 14336): (8, 128, 4, 3),
    (14, 1, 6144, 4096): (8, 256, 8, 3),
    (14, 1, 28672, 4096): (8, 256, 8, 3),
    (14, 2, 4096, 4096): (16, 32, 4, 3),
    (14, 2, 4096, 14336): (16, 64, 8, 3),
    (14, 2, 6144, 4096): (16, 32, 4, 3),
    (14, 2, 28672, 4096): (32, 32, 8, 3),
    (14, 4, 4096, 4096): (16, 32, 8, 3),
    (14, 4, 4096, 14336): (16, 32, 8, 3),
    (14, 4, 6144, 4096): (16, 16, 4, 3),
    (14, 4, 28672, 4096): (32, 16, 8, 3),
}


@triton.jit
def _split4(t):
    """t [..., 2, 2] -> its four [...] slices in the order (0, 0), (0, 1), (1, 0), (1, 1)."""
    t0, t1 = tl.split(t)
    t00, t10 = tl.split(t0)
    t01, t11 = tl.split(t1)
    return t00, t01, t10, t11


@triton.jit
def _in_shared(a, M_PAD: tl.constexpr, COLS: tl.constexpr):
    """a [M_PAD, COLS] as is. A reduction over a new axis of one: Triton would otherwise move x's
    tile into the weight's layout before its conversion to float32 (and the prologue), and each
    thread would convert every x value it takes, once for each of its weight's rows; after a
    reduction the tile is computed once, in its own layout, and goes through shared memory as is."""
    return tl.sum(tl.reshape(a, [M_PAD, COLS, 1]), 2)


@triton.jit
def _byte_values_dot(part, a, v, z: tl.constexpr, BITS: tl.constexpr, M_PAD: tl.constexpr, CHUNKS: tl.constexpr,
                     CHUNK: tl.constexpr):
    """part + the dot of the four BITS-bit values at bits 0, 8, 16, 24 of v (q - z each) with a
    [M_PAD, CHUNKS, CHUNK, 4] (x at their columns, bytes 1 and 3 times 2^-8)."""
    a0, a1, a2, a3 = _split4(tl.reshape(a, [M_PAD, CHUNKS, CHUNK, 2, 2]))
    low = v | 0x4B000000
    high = (v >> 16) | 0x4B000000
    part = _values_dot(part, a0, low, z, BITS, 0)
    part = _values_dot(part, a1, low, z, BITS, 1)
    part = _values_dot(part, a2, high, z, BITS, 0)
    return _values_dot(part, a3, high, z, BITS, 1)


@triton.jit
def _gguf_word_gemv_kernel(x_ptr, res_ptr, nw_ptr, q_ptr, h_ptr, d_ptr, m_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, hout_ptr,
                           stride_x, stride_r, stride_y, stride_h, N, eps, M: tl.constexpr, M_PAD: tl.constexpr,
                           K: tl.constexpr, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr,
                           PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                           STAGES: tl.constexpr):
    # the words a row: qs (Q6_K: qh) as int32; a chunk's words share their scales
    PER: tl.constexpr = 16 if QTYPE == 14 else (4 if QTYPE == 8 else 8)  # values a word
    WORDS: tl.constexpr = K // PER
    # Q8_0: a block's 8 words at one row, half a block (fewer barriers where x's tile moves) at more
    CHUNK: tl.constexpr = 8 if QTYPE == 12 or (QTYPE == 8 and M_PAD == 1) else 4
    CHUNKS: tl.constexpr = BLOCK_J // CHUNK
    SPAN: tl.constexpr = 64 if QTYPE == 12 else 32  # the nibble types' (module docstring)
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, M_PAD)
    mmask = m < M
    inv = tl.zeros([M_PAD], tl.float32)
    if PROLOGUE == 1:
        inv = inv_rms(x_ptr, res_ptr, m, mmask, stride_x, stride_r, eps, K, M_PAD, 2048 // M_PAD, HAS_RES)
    n4 = n.to(tl.int64)[None, None, :, None]
    nmask4 = nmask[None, None, :, None]
    first = (tl.arange(0, CHUNKS) * CHUNK)[None, :, None, None]  # each chunk's first word in the tile
    word = first + tl.arange(0, CHUNK)[None, None, None, :]
    # x's columns in the first tile (word kk // PER, position kk % PER); tile j0's are PER * j0 further;
    # 2^-shift of each (a byte's value at bit 8 of its half word, a nibble's at 4, 8 or 12: _values_dot)
    kk = tl.arange(0, BLOCK_J * PER)
    if QTYPE == 14 or QTYPE == 8:
        shift = 8 * (kk % 2)
    else:
        shift = 4 * (kk % 4)
    unshift = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift, built (no int -> float)
    w = kk // PER
    p = kk % PER
    if QTYPE == 14:
        col0 = 128 * (w // 8) + 4 * (w % 8) + 32 * (p // 4) + p % 4
    elif QTYPE == 8:
        col0 = kk
    else:
        col0 = SPAN * (w // (SPAN // 8)) + 4 * (w % (SPAN // 8)) + p // 2 + (SPAN // 2) * (p % 2)
    acc = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
    acc_min = tl.zeros([M_PAD, CHUNKS, BLOCK_N], tl.float32)  # the minimums' terms (Q4_1, Q4_K)
    for j0 in tl.range(0, WORDS, BLOCK_J, num_stages=STAGES):
        j = j0 + word
        wmask = nmask4 & (j < WORDS)
        c = (j0 + first) // CHUNK  # the chunks' index in the row
        cmask4 = nmask4 & (j0 + first < WORDS)
        col = PER * j0 + col0
        kmask = (j0 + w < WORDS)[None, :]
        a = prologue_input(x_ptr, res_ptr, nw_ptr, hout_ptr, m[:, None], col[None, :], mmask[:, None] & kmask,
                           kmask, inv[:, None], pid == 0, stride_x, stride_r, stride_h, K, PROLOGUE, HAS_RES)
        if QTYPE == 3 or QTYPE == 12:  # sums of x over each chunk's lo (p even) and hi (p odd) nibbles
            x_lo, x_hi = tl.split(tl.reshape(a, [M_PAD, CHUNKS, CHUNK * 4, 2]))
            sum_lo = tl.sum(x_lo, 2)[:, :, None, None]
            sum_hi = tl.sum(x_hi, 2)[:, :, None, None]
        a = _in_shared(a * unshift[None, :], M_PAD, BLOCK_J * PER)
        if QTYPE == 8:  # int8 q: q + 128 is the byte with its top bit flipped
            words = tl.load(q_ptr + n4 * WORDS + j, mask=wmask, other=0) ^ -0x7F7F7F80  # 0x80808080
            d = tl.load(d_ptr + n4 * (K // 32) + (j0 + first) // 8, mask=cmask4, other=0.0).to(tl.float32)
            part = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
            acc += _byte_values_dot(part, tl.reshape(a, [M_PAD, CHUNKS, CHUNK, 4]), words, 128.0, 8, M_PAD, CHUNKS,
                                    CHUNK) * d
        elif QTYPE == 14:
            qh = tl.load(h_ptr + n4 * WORDS + j, mask=wmask, other=0)
            ql = q_ptr + n4 * (K // 8) + 32 * (j // 16) + 16 * ((j % 16) // 8) + j % 8
            lo = tl.load(ql, mask=wmask, other=0)
            hi = tl.load(ql + 8, mask=wmask, other=0)
            v0 = (lo & 0x0F0F0F0F) | ((qh << 4) & 0x30303030)
            v1 = (hi & 0x0F0F0F0F) | ((qh << 2) & 0x30303030)
            v2 = ((lo >> 4) & 0x0F0F0F0F) | (qh & 0x30303030)
            v3 = ((hi >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030)
            a = tl.reshape(a, [M_PAD, CHUNKS, CHUNK, 2, 2, 4])
            a = tl.permute(a, [0, 1, 2, 5, 3, 4])  # [..., b, i // 2, i % 2]: split the values' i
            a0, a1, a2, a3 = _split4(a)
            zero = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
            d = tl.load(d_ptr + n4 * (K // 256) + c // 4, mask=cmask4, other=0.0).to(tl.float32)
            sc = s_ptr + n4 * (K // 16) + 16 * (c // 4) + 8 * ((c % 4) // 2) + c % 2
            for_v0 = _byte_values_dot(zero, a0, v0, 32.0, 8, M_PAD, CHUNKS, CHUNK)
            acc += for_v0 * (d * tl.load(sc, mask=cmask4, other=0).to(tl.float32))
            for_v1 = _byte_values_dot(zero, a1, v1, 32.0, 8, M_PAD, CHUNKS, CHUNK)
            acc += for_v1 * (d * tl.load(sc + 2, mask=cmask4, other=0).to(tl.float32))
            for_v2 = _byte_values_dot(zero, a2, v2, 32.0, 8, M_PAD, CHUNKS, CHUNK)
            acc += for_v2 * (d * tl.load(sc + 4, mask=cmask4, other=0).to(tl.float32))
            for_v3 = _byte_values_dot(zero, a3, v3, 32.0, 8, M_PAD, CHUNKS, CHUNK)
            acc += for_v3 * (d * tl.load(sc + 6, mask=cmask4, other=0).to(tl.float32))
        else:
            words = tl.load(q_ptr + n4 * WORDS + j, mask=wmask, other=0)
            a = tl.reshape(a, [M_PAD, CHUNKS, CHUNK, 4, 2])
            a_even, a_odd = tl.split(a)  # p even, odd
            a0, a2, a4, a6 = _split4(tl.reshape(a_even, [M_PAD, CHUNKS, CHUNK, 2, 2]))
            a1, a3, a5, a7 = _split4(tl.reshape(a_odd, [M_PAD, CHUNKS, CHUNK, 2, 2]))
            low = words | 0x4B000000
            high = (words >> 16) | 0x4B000000
            z: tl.constexpr = 8.0 if QTYPE == 2 else 0.0
            part = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
            part = _values_dot(part, a0, low, z, 4, 0)
            part = _values_dot(part, a2, low, z, 4, 2)
            part = _values_dot(part, a4, high, z, 4, 0)
            part = _values_dot(part, a6, high, z, 4, 2)
            if QTYPE == 12:  # the hi nibbles are the next sub-block: scales of their own
                d = tl.load(d_ptr + n4 * (K // 256) + c // 4, mask=cmask4, other=0.0).to(tl.float32)
                dmin = tl.load(m_ptr + n4 * (K // 256) + c // 4, mask=cmask4, other=0.0).to(tl.float32)
                sub = s_ptr + n4 * (K // 32) + 2 * c
                msub = mn_ptr + n4 * (K // 32) + 2 * c
                acc += part * (d * tl.load(sub, mask=cmask4, other=0).to(tl.float32))
                part = tl.zeros([M_PAD, CHUNKS, BLOCK_N, CHUNK], tl.float32)
                part = _values_dot(part, a1, low, z, 4, 1)
                part = _values_dot(part, a3, low, z, 4, 3)
                part = _values_dot(part, a5, high, z, 4, 1)
                part = _values_dot(part, a7, high, z, 4, 3)
                acc += part * (d * tl.load(sub + 1, mask=cmask4, other=0).to(tl.float32))
                mn_lo = dmin * tl.load(msub, mask=cmask4, other=0).to(tl.float32)
                mn_hi = dmin * tl.load(msub + 1, mask=cmask4, other=0).to(tl.float32)
                acc_min -= tl.sum(mn_lo * sum_lo + mn_hi * sum_hi, 3)
            else:
                part = _values_dot(part, a1, low, z, 4, 1)
                part = _values_dot(part, a3, low, z, 4, 3)
                part = _values_dot(part, a5, high, z, 4, 1)
                part = _values_dot(part, a7, high, z, 4, 3)
                d = tl.load(d_ptr + n4 * (K // 32) + c, mask=cmask4, other=0.0).to(tl.float32)
                acc += part * d
                if QTYPE == 3:
                    mins = tl.load(m_ptr + n4 * (K // 32) + c, mask=cmask4, other=0.0).to(tl.float32)
                    acc_min += tl.sum(mins * (sum_lo + sum_hi), 3)
    y = tl.sum(tl.sum(acc, 3), 1) + tl.sum(acc_min, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def gguf_word_gemv_config(qtype: int, rows: int, n: int, k: int, fill_gpu: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_J words, num_warps, num_stages): TUNED's entry where it has one. Otherwise
    int_gemv's reasoning (its first guess, for shapes the sweep did not time): at one row 16 rows of W a
    program and 2048 values a step (256 qs words; Q6_K 128 qh words with their 256 ql words),
    8 warps, 3 stages in flight; fewer rows a program (down to 4, and warps with them) while
    that leaves under two programs an SM of the H100 (132); BLOCK_J halves as rows double, so
    the accumulators keep to the registers. On Triton's interpreter (fill_gpu False) the fewest
    programs run fastest."""
    per = {8: 4, 14: 16}.get(qtype, 8)
    words = triton.next_power_of_2(k // per)
    m_pad = triton.next_power_of_2(rows)
    if not fill_gpu:
        return 16, min(64, words), 4, 1
    if (qtype, m_pad, n, k) in TUNED:
        return TUNED[qtype, m_pad, n, k]
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, max(8, min(2048 // per // m_pad, words)), block_n // 2, 3


def gguf_word_gemv(x: torch.Tensor, qtype: int, planes: tuple, n: int, bias: torch.Tensor | None = None,
                   prologue: str = "none", residual: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                   config: tuple[int, int, int, int] | None = None):
    """gguf.py's gguf_gemv for a type of WORD_TYPES, its arguments checked there: x [M <= 4, K]
    ([M, 2K] for "silu") times the GGUF weight [n, K]^T (+ bias) -> y [M, n] in x's dtype, and h
    with the norm prologue."""
    rows = x.shape[0]
    k = x.shape[-1] // 2 if prologue == "silu" else x.shape[-1]
    qs, qh, d, m, sc, mn = planes
    q_words = qs.view(torch.int32)  # [n, K / 8]: contiguous, fresh planes (4-byte aligned)
    h_words = qh.view(torch.int32) if qtype == 14 else q_words
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    block_n, block_j, warps, stages = config or gguf_word_gemv_config(qtype, rows, n, k, x.is_cuda)
    if block_j < 8 or block_j & (block_j - 1):  # a chunk (Q6_K: half a super-block's qh) fits in a tile
        raise ValueError(f"the word GEMV's BLOCK_J is a power of two of 8 words or more, got {block_j}")
    _gguf_word_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, q_words, h_words,
        d, m if m is not None else d, sc if sc is not None else qs, mn if mn is not None else qs,
        bias if bias is not None else x, y, h, x.stride(0), residual.stride(0) if residual is not None else 0,
        y.stride(0), h.stride(0), n, eps, M=rows, M_PAD=triton.next_power_of_2(rows), K=k, QTYPE=qtype,
        BLOCK_N=block_n, BLOCK_J=block_j, PROLOGUE=PROLOGUES[prologue], HAS_RES=residual is not None,
        HAS_BIAS=bias is not None, STAGES=stages, num_warps=warps)
    return (y, h) if prologue == "norm" else y
