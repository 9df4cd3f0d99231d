"""The fused mixture-of-experts path for layers/moe.py on CUDA: five kernels, none of which
reads a value back to the host, so CUDA graphs capture MoE decode.

    route_topk      router logits [T, E] -> top-k weights [T, k] (float32) and expert ids
                    [T, k]: softmax in float32, the k largest, renormalized if asked
    align_experts   the T*k (token, slot) pairs grouped by expert, each expert's group padded
                    to BLOCK_M rows: `sorted_pairs` (pair index, or T*k for padding),
                    `block_expert` (the expert of each BLOCK_M rows), `num_padded` (rows used)
    moe_gemm        per block of BLOCK_M sorted pairs, all of one expert:
                    gate|up pass:  g, u = x[token] @ w13[e, :I]^T (+ b13[e, :I]), x[token] @ w13[e, I:]^T (+ b13[e, I:])
                                   act[pair] = silu(g) * u, or gpt-oss's clamped SwiGLU of (g, u)
                    down pass:     out[pair] = weight[pair] * (act[pair] @ w2[e]^T (+ b2[e]))
    then the k rows of each token are summed (torch).

The experts' weights are dense (x's dtype), MXFP4 (MXFP4Experts: e2m1 values with a
power-of-two scale per 32, decoded to x's dtype in registers before each tl.dot; Hopper has
no FP4 tensor cores, so the saving is the bytes read: 4.25 bits a weight) or FP8
(FP8Experts: e4m3 values with a float32 scale per row or per 128 x 128 block, DeepSeek-V3's
and Qwen3-FP8's; weight-only: each value times its scale in float32, rounded to x's dtype,
as the dequantized checkpoint holds it, then tl.dot in x's dtype; 8 bits a weight). A
block-scaled FP8 k-tile is at most 128 wide, so it lies in one scale block (BLOCK_K, a power
of two, divides 128); rows look their scale up one by one, so N tiles may span blocks:

    w13 [E, 2I, H]: rows  0 ........ I-1 | I ........ 2I-1       (gate | up)
    scale blocks       0 .. ceil(I/128)-1 | ceil(I/128) .. 2 ceil(I/128)-1
    a gate row n: block n // 128; its up row n + I: block ceil(I/128) + n // 128

so an intermediate size that is no multiple of 128 keeps each half's blocks its own.

Integer experts (IntExperts: AWQ / GPTQ / compressed-tensors W4A16 and W8A16, packed as
layers/quant/int_weight.py's IntWeight is on CUDA, one such weight an expert) are unpacked in
registers by kernels/wna16.py's unpack_values: a k-tile lies in one group (BLOCK_K
divides the group size, or one group spans the row), so the GEMM multiplies x by q - zero
(a small integer: exact in x's dtype) and scales the tile's float32 sums once a row; the
GEMV scales each value in float32. 4.25 (8.25) bits a weight at groups of 128 with zeros.

    w13 qweight [E, 2I, ceil(H / per)]  scales, zeros [E, 2I, ceil(H / group)]   per = 32 / bits
    w2  qweight [E, H, ceil(I / per)]   scales, zeros [E, H, ceil(I / group)]

align_experts sizes its outputs for the worst case (every pair's expert padded), so shapes
depend on T only. The order of pairs inside an expert's group does not change any result:
each row is computed on its own and the top-k sum runs in slot order.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.tiles import grouped_tile
from ember.kernels.wna16 import unpack_values

FP8_BLOCK = 128  # block-scaled FP8 weights: one scale per 128 x 128 block
# the kernels' WEIGHTS (how a weight tile is read), which they compare with these numbers
DENSE, MXFP4, FP8_ROWS, FP8_BLOCKS, INT = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class MXFP4Experts:
    """Stacked expert weights [E, N, K] kept as MXFP4 (gpt-oss's checkpoints): `blocks` uint8
    [E, N, K / 2], two e2m1 values a byte, the low nibble the even k; `scales` uint8
    [E, N, K / 32], one e8m0 exponent (2^(s - 127)) per 32 values of a row. moe_gemm
    decodes them in registers and multiplies in the activations' dtype."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8 or b.dim() != 3 or s.shape != (*b.shape[:2], b.shape[2] // 16) \
                or b.shape[2] % 16 or b.stride(2) != 1 or s.stride(2) != 1:
            raise ValueError(f"MXFP4 blocks {tuple(b.shape)} {b.dtype} and scales {tuple(s.shape)} {s.dtype}: expected "
                             "uint8 [E, N, K / 2] and [E, N, K / 32] with contiguous rows")

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half_k = self.blocks.shape
        return e, n, 2 * half_k


@dataclass(frozen=True)
class FP8Experts:
    """Stacked expert weights [E, N, K] kept as FP8 (a float8_e4m3fn checkpoint's): `weight`
    float8_e4m3fn [E, N, K]; `scale` float32, a dequantization multiplier (W_real = W * scale)
    per row [E, N], or per 128 x 128 block [E, row blocks, ceil(K / 128)] as DeepSeek-V3's
    `weight_scale_inv` holds it. A gate|up weight's row blocks are its halves' (module doc):
    2 ceil(I / 128) of them, ceil(N / 128) for any other weight."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        w, s = self.weight, self.scale
        e, n, k = w.shape if w.dim() == 3 else (0, 0, 0)
        row = s.dim() == 2 and s.shape == (e, n)
        block = s.dim() == 3 and s.shape[0] == e and s.shape[2] == triton.cdiv(k, FP8_BLOCK)
        if w.dtype != torch.float8_e4m3fn or w.dim() != 3 or w.stride(2) != 1 or s.dtype != torch.float32 \
                or not (row or block) or s.stride(-1) != 1:
            raise ValueError(f"FP8 weights {tuple(w.shape)} {w.dtype} and scales {tuple(s.shape)} {s.dtype}: expected "
                             "float8_e4m3fn [E, N, K] with contiguous rows and float32 scales [E, N] (per row) or "
                             "[E, row blocks, ceil(K / 128)] (per 128 x 128 block)")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.weight.shape)

    @property
    def blockwise(self) -> bool:
        return self.scale.dim() == 3


@dataclass(frozen=True)
class IntExperts:
    """Stacked expert weights [E, N, K] kept as `bits`-bit integers with a scale (and a zero
    point) a group of `group_size` columns (module doc): `qweight` int32 [E, N, ceil(K / per)],
    value k of a row at bits (k % per) * bits of word k // per; `scales` float [E, N, G];
    `zeros` uint8 [E, N, G] or None (2^(bits - 1): symmetric); group_size K for one group a row.
    W[e, n, k] = (q - zeros[e, n, k // group_size]) * scales[e, n, k // group_size]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    def __post_init__(self) -> None:
        q, s, z = self.qweight, self.scales, self.zeros
        e, n = (q.shape[0], q.shape[1]) if q.dim() == 3 else (0, 0)
        words, groups = triton.cdiv(self.in_features, 32 // self.bits), triton.cdiv(self.in_features, self.group_size)
        if self.bits not in (4, 8) or q.dtype != torch.int32 or tuple(q.shape) != (e, n, words) or q.stride(2) != 1 \
                or not s.is_floating_point() or tuple(s.shape) != (e, n, groups) or s.stride(2) != 1 \
                or (z is not None and (z.dtype != torch.uint8 or z.shape != s.shape or z.stride(2) != 1)):
            raise ValueError(f"integer experts of {self.bits} bits, K={self.in_features} in groups of "
                             f"{self.group_size}: expected int32 qweight [E, N, {words}], float scales and uint8 "
                             f"zeros [E, N, {groups}] with contiguous rows; got qweight {q.dtype} {tuple(q.shape)}, "
                             f"scales {s.dtype} {tuple(s.shape)}, zeros "
                             f"{None if z is None else (z.dtype, tuple(z.shape))}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.qweight.shape[0], self.qweight.shape[1], self.in_features


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    total = 0.0
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(p, 0, tie_break_left=True)
        w = tl.max(p, 0)
        total += w
        tl.store(weights_ptr + t * TOP_K + slot, w)
        tl.store(ids_ptr + t * TOP_K + slot, best.to(tl.int32))
        p = tl.where(e == best, -1.0, p)
    if RENORMALIZE:
        for slot in tl.static_range(TOP_K):
            w = tl.load(weights_ptr + t * TOP_K + slot)
            tl.store(weights_ptr + t * TOP_K + slot, w / total)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int32), as
    softmax(float32) -> topk -> optional renormalizing does in torch."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, router_logits.stride(0), experts, TOP_K=top_k,
                                 RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(experts))
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, E, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=BLOCK_E - 1)
        hit = start + offs < num_pairs
        counts += tl.histogram(ids, BLOCK_E, mask=hit)
    e = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + e, counts, mask=e < E)


@triton.jit
def _scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, E,
                    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    # program `expert`: where its group starts (the padded counts of the experts before it),
    # then its pairs in order, then its padding rows and its blocks' expert id
    expert = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(e < expert, padded, 0), 0)
    mine = tl.sum(tl.where(e == expert, counts, 0), 0)
    mine_padded = tl.sum(tl.where(e == expert, padded, 0), 0)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    offs = tl.arange(0, CHUNK)
    placed = start
    for chunk in range(0, num_pairs, CHUNK):
        pair = chunk + offs
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, 0) - 1
        tl.store(sorted_ptr + placed + rank, pair, mask=hit > 0)
        placed += tl.sum(hit, 0)
    for pad in range(mine, mine_padded, CHUNK):
        row = pad + offs
        tl.store(sorted_ptr + start + row, num_pairs, mask=row < mine_padded)
    for block in range(start // BLOCK_M, (start + mine_padded) // BLOCK_M):
        tl.store(block_expert_ptr + block, expert)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of align_experts' output in the worst case: each expert with a pair adds at most
    block_m - 1 padding rows, and at most min(E, pairs) experts have one."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def align_experts(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (sorted_pairs [R] int32, block_expert [R / block_m] int32,
    num_padded [1] int32), R = max_padded_rows(T * k, E, block_m). Rows past num_padded are
    unused, and so are their blocks."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    rows = max_padded_rows(pairs, num_experts, block_m)
    dev = ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(triton.cdiv(rows, block_m), dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
    if pairs:
        block_e = triton.next_power_of_2(num_experts)
        _count_kernel[(1,)](flat, counts, pairs, num_experts, BLOCK_E=block_e, CHUNK=1024)
        _scatter_kernel[(num_experts,)](flat, counts, sorted_pairs, block_expert, num_padded, pairs, num_experts,
                                        BLOCK_E=block_e, BLOCK_M=block_m, CHUNK=256)
    return sorted_pairs, block_expert, num_padded


@triton.jit
def _e2m1(nibble):
    """e2m1 codes (sign, 2 exponent bits, 1 mantissa bit; 0 +-0.5 +-1 +-1.5 +-2 +-3 +-4 +-6)
    -> float32, as the bits of the float32 of each of the 16 values."""
    nibble = nibble.to(tl.uint32)
    e = (nibble >> 1) & 3
    m = nibble & 1
    magnitude = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))  # 0.5 * m, or 2^(e-1) * (1 + m / 2)
    return (magnitude | ((nibble >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_rows(n, half, N, WEIGHTS: tl.constexpr):
    """Where the FP8 scales of rows n of a weight's half (0: gate, or a weight of one half; 1:
    up, whose rows are n + N) sit: its row blocks (module doc), or its rows."""
    if WEIGHTS == 3:
        srows = n // 128 + half * tl.cdiv(N, 128)
    else:
        srows = n + half * N
    return srows


@triton.jit
def _fp8_scales(s_base, srows, rmask, k0, stride_sn, WEIGHTS: tl.constexpr):
    """[rows] float32: each row's scale (per row), or its block's in the k-tile from k0, which
    lies in block k0 // 128 (BLOCK_K divides 128)."""
    if WEIGHTS == 3:
        ptrs = s_base + srows * stride_sn + k0 // 128
    else:
        ptrs = s_base + srows * stride_sn
    return tl.load(ptrs, mask=rmask, other=0.0)


@triton.jit
def _weight_tile(w_base, s_base, rows, srows, rmask, k0, K, stride_wn, stride_sn, WEIGHTS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile w[rows, k0:k0 + BLOCK_K]^T of one expert's weight: loaded as
    it is, decoded from MXFP4 (float32; the caller casts it to the activations' dtype, exactly:
    an e2m1 value times a power of two fits bfloat16), or FP8 values times their scales
    (`srows`: _scale_rows) in float32, which the caller's cast rounds once."""
    if WEIGHTS == 1:
        # bytes [BLOCK_N, BLOCK_K / 2] -> values [BLOCK_N, BLOCK_K / 2, 2] (low nibble, high) -> k = 2j + nibble
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_base + rows[:, None] * stride_wn + kb[None, :], mask=rmask[:, None] & (kb < K // 2)[None, :],
                         other=0)
        values = tl.reshape(tl.join(_e2m1(packed & 0xF), _e2m1(packed >> 4)), (BLOCK_N, BLOCK_K))
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exps = tl.load(s_base + rows[:, None] * stride_sn + ks[None, :], mask=rmask[:, None] & (ks < K // 32)[None, :],
                       other=127).to(tl.uint32)
        # 2^(s - 127) as float32 bits; s = 0 is the subnormal 2^-127
        scales = tl.maximum(exps << 23, 0x400000).to(tl.float32, bitcast=True)
        values = tl.reshape(tl.reshape(values, (BLOCK_N, BLOCK_K // 32, 32)) * scales[:, :, None], (BLOCK_N, BLOCK_K))
        tile = tl.trans(values)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w_base + rows[None, :] * stride_wn + k[:, None], mask=rmask[None, :] & (k < K)[:, None],
                       other=0.0)
        if WEIGHTS >= 2:
            tile = tile.to(tl.float32) * _fp8_scales(s_base, srows, rmask, k0, stride_sn, WEIGHTS)[None, :]
    return tile


@triton.jit
def _int_scales(s_base, z_base, rows, rmask, k0, stride_sn, stride_zn, BITS: tl.constexpr, GROUP: tl.constexpr,
                HAS_ZEROS: tl.constexpr):
    """(scale [rows] float32, zero point [rows] int32) of the group holding the k-tile from k0."""
    g = k0 // GROUP
    s = tl.load(s_base + rows * stride_sn + g, mask=rmask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_base + rows * stride_zn + g, mask=rmask, other=0).to(tl.int32)
    else:
        z = tl.zeros_like(rows).to(tl.int32) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _int_dot(acc, a, w_base, s_base, z_base, rows, rmask, k0, K, stride_wn, stride_sn, stride_zn, BITS: tl.constexpr,
             GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += (a @ (q - zero)^T) * scale for the k-tile from k0 of integer
    weight rows `rows`, which lies in one group: q - zero is exact in a's dtype, and the tile's
    float32 sums take their row's scale once."""
    q = unpack_values(w_base, rows, rmask, k0, stride_wn, K, BITS, BLOCK_N, BLOCK_K)
    s, z = _int_scales(s_base, z_base, rows, rmask, k0, stride_sn, stride_zn, BITS, GROUP, HAS_ZEROS)
    w = tl.trans((q - z[:, None]).to(tl.float32).to(a.dtype))
    if IEEE:
        part = tl.dot(a, w, input_precision="ieee")
    else:
        part = tl.dot(a, w)
    return acc + part * s[None, :]


@triton.jit
def _e2m1_scaled_down(nibbles):
    """e2m1 codes held at bits 0-3 (low nibble) -> their values times 2^-14, float32, in a few
    bit operations: sign to bit 15 and the three magnitude bits to bits 9-11 of a float16 make
    its exponent e and top mantissa bit m, i.e. 2^(e - 15) (1 + m / 2), and for e = 0 the
    subnormal m 2^-15: each e2m1 value times 2^-14 (float16 keeps its subnormals)."""
    return (((nibbles & 0x8) << 12) | ((nibbles & 0x7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_mxfp4_tile(acc, a_ptr, a_row, stride_a, w_base, s_base, rows, rmask, k0, K, stride_wn, stride_sn,
                     BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 32] float32 += each 32-value group's dot with `a`, times its scale.
    The tile is read as [BLOCK_N, groups, 16] bytes, so a group's 16 bytes are one vector and its
    scale broadcasts along them without a reshape; a's even and odd k meet the low and high
    nibbles (times 2^14, which _e2m1_scaled_down takes off: all exact in float32)."""
    g = tl.arange(0, BLOCK_K // 32)
    j = tl.arange(0, 16)
    kb = (k0 // 2 + g[:, None] * 16 + j[None, :])  # [groups, 16] byte offsets in the row
    kmask = kb < K // 2
    packed = tl.load(w_base + rows[:, None, None] * stride_wn + kb[None, :, :],
                     mask=rmask[:, None, None] & kmask[None, :, :], other=0).to(tl.uint16)
    a_even = tl.load(a_ptr + a_row * stride_a + 2 * kb, mask=kmask, other=0.0).to(tl.float32) * 16384.0
    a_odd = tl.load(a_ptr + a_row * stride_a + 2 * kb + 1, mask=kmask, other=0.0).to(tl.float32) * 16384.0
    dots = tl.sum(_e2m1_scaled_down(packed) * a_even[None, :, :] + _e2m1_scaled_down(packed >> 4) * a_odd[None, :, :],
                  2)
    ks = k0 // 32 + g
    exps = tl.load(s_base + rows[:, None] * stride_sn + ks[None, :], mask=rmask[:, None] & (ks < K // 32)[None, :],
                   other=127).to(tl.uint32)
    # 2^(s - 127) as float32 bits; s = 0 is the subnormal 2^-127
    return acc + dots * tl.maximum(exps << 23, 0x400000).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_tile(acc, a_ptr, a_row, stride_a, w_base, s_base, z_base, rows, srows, rmask, k0, K, stride_wn, stride_sn,
               stride_zn, WEIGHTS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMV's step over one k-tile: acc float32 [BLOCK_N, BLOCK_K] (MXFP4: [BLOCK_N, groups])
    of partial sums, reduced along its last axis once at the end by the caller. FP8 values
    times their scales are rounded to a's dtype first, as the GEMM's tl.dot takes them;
    integers (q - zero) times their group's scale stay float32, as the GEMM scales its sums."""
    if WEIGHTS == 1:
        acc = _gemv_mxfp4_tile(acc, a_ptr, a_row, stride_a, w_base, s_base, rows, rmask, k0, K, stride_wn,
                               stride_sn, BLOCK_K)
    elif WEIGHTS == 4:
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row * stride_a + k, mask=k < K, other=0.0).to(tl.float32)
        q = unpack_values(w_base, rows, rmask, k0, stride_wn, K, BITS, BLOCK_N, BLOCK_K)
        s, z = _int_scales(s_base, z_base, rows, rmask, k0, stride_sn, stride_zn, BITS, GROUP, HAS_ZEROS)
        acc += (q - z[:, None]).to(tl.float32) * s[:, None] * a[None, :]
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row * stride_a + k, mask=k < K, other=0.0)
        w = tl.load(w_base + rows[:, None] * stride_wn + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0)
        if WEIGHTS >= 2:
            w = (w.to(tl.float32) * _fp8_scales(s_base, srows, rmask, k0, stride_sn, WEIGHTS)[:, None]).to(a.dtype)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    return acc


@triton.jit
def _epilogue(acc, acc_up, expert, pair, valid, n, nmask, N, c_ptr, stride_c, weights_ptr, bias_ptr, stride_be,
              alpha, limit, GATED: tl.constexpr, WEIGHTED: tl.constexpr, BIASED: tl.constexpr,
              ACTIVATION: tl.constexpr):
    """Rows `pair` x outputs n of a pass from its float32 sums [rows, n]: the expert's bias, the
    activation (gate|up pass), the routing weight (down pass), stored in c's dtype."""
    if BIASED:  # the expert's bias row: [gate | up] (2N) in the gate|up pass, N in the down pass
        b_base = bias_ptr + expert * stride_be
        acc += tl.load(b_base + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_base + N + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 1:  # gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:  # after the down bias, as transformers' gpt-oss weighs (x @ w2 + b2)
        acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * stride_c + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
                     bias_ptr, num_pairs, N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_ze,
                     stride_zn, stride_c, stride_be, rows_per_a, alpha, limit, GATED: tl.constexpr,
                     WEIGHTED: tl.constexpr, BIASED: tl.constexpr, ACTIVATION: tl.constexpr, WEIGHTS: tl.constexpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.num_programs(0) // tiles_n, tiles_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    a_rows = (pair // rows_per_a).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    s_gate, s_up = _scale_rows(n, 0, N, WEIGHTS), _scale_rows(n, 1, N, WEIGHTS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k < K)[None, :], other=0.0)
        if WEIGHTS == 4:
            acc = _int_dot(acc, a, w_base, s_base, z_base, n, nmask, k0, K, stride_wn, stride_sn, stride_zn, BITS,
                           GROUP, HAS_ZEROS, IEEE, BLOCK_N, BLOCK_K)
            if GATED:  # the up rows of w13 sit N rows below the gate rows
                acc_up = _int_dot(acc_up, a, w_base, s_base, z_base, n + N, nmask, k0, K, stride_wn, stride_sn,
                                  stride_zn, BITS, GROUP, HAS_ZEROS, IEEE, BLOCK_N, BLOCK_K)
        else:
            w = _weight_tile(w_base, s_base, n, s_gate, nmask, k0, K, stride_wn, stride_sn, WEIGHTS, BLOCK_N,
                             BLOCK_K).to(a.dtype)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if GATED:  # the up rows of w13 sit N rows below the gate rows
                u = _weight_tile(w_base, s_base, n + N, s_up, nmask, k0, K, stride_wn, stride_sn, WEIGHTS, BLOCK_N,
                                 BLOCK_K).to(a.dtype)
                if IEEE:
                    acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, u, acc_up)
    _epilogue(acc, acc_up, expert, pair, valid, n, nmask, N, c_ptr, stride_c, weights_ptr, bias_ptr, stride_be, alpha,
              limit, GATED, WEIGHTED, BIASED, ACTIVATION)


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, ids_ptr, weights_ptr, bias_ptr, N, K, stride_a, stride_we,
                     stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_c, stride_be, rows_per_a, alpha,
                     limit, GATED: tl.constexpr, WEIGHTED: tl.constexpr, BIASED: tl.constexpr,
                     ACTIVATION: tl.constexpr, WEIGHTS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (tile of N, pair): the pair's row of `a` against BLOCK_N rows of its expert, the
    # products summed along k into a float32 block (_gemv_tile), reduced once at the end
    p = tl.program_id(1)
    pair = p + tl.arange(0, 1)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    a_row = (p // rows_per_a).to(tl.int64)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    z_base = z_ptr + expert * stride_ze
    s_gate, s_up = _scale_rows(n, 0, N, WEIGHTS), _scale_rows(n, 1, N, WEIGHTS)
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32 if WEIGHTS == 1 else BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // 32 if WEIGHTS == 1 else BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _gemv_tile(acc, a_ptr, a_row, stride_a, w_base, s_base, z_base, n, s_gate, nmask, k0, K, stride_wn,
                         stride_sn, stride_zn, WEIGHTS, BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
        if GATED:  # the up rows of w13 sit N rows below the gate rows
            acc_up = _gemv_tile(acc_up, a_ptr, a_row, stride_a, w_base, s_base, z_base, n + N, s_up, nmask, k0, K,
                                stride_wn, stride_sn, stride_zn, WEIGHTS, BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_K)
    _epilogue(tl.sum(acc, 1)[None, :], tl.sum(acc_up, 1)[None, :], expert, pair, pair >= 0, n, nmask, N, c_ptr,
              stride_c, weights_ptr, bias_ptr, stride_be, alpha, limit, GATED, WEIGHTED, BIASED, ACTIVATION)


def heuristic_config(num_experts: int, tokens: int, top_k: int, quant: str | None = None) -> dict[str, int]:
    """Tile sizes by the rows each expert gets on average (T * k / E): while few, the GEMV
    (GEMV: 1; each pair alone, an expert read once per pair it has): up to one pair in four
    experts, or one an expert for MXFP4 experts (quant "mxfp4"), whose decode costs the GEMM more
    (H100, gpt-oss-120b at 16 tokens: 0.64 ms against 1.21); then 16-row blocks while experts see
    few tokens (decode: the weights' bytes bound the step), larger ones as the GEMMs fill. FP8
    experts (quant "fp8") and integer ones ("int4", "int8") take the dense tiles (not yet
    measured apart; block scales cap BLOCK_K at 128, integer groups at the group size, in the
    wrappers). Used where moe_configs.json has no entry for the GPU."""
    mxfp4 = quant == "mxfp4"
    per_expert = tokens * top_k / num_experts
    if per_expert <= (1.0 if mxfp4 else 0.25):
        if mxfp4:
            return {"GEMV": 1, "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 2, "num_stages": 3}
        return {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    if per_expert <= 256:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}


def config_key(num_experts: int, hidden: int, inter: int, top_k: int, quant: str | None = None) -> str:
    """moe_configs.json's key of a shape; quantized experts ("mxfp4", "fp8", "int4", "int8") under their own."""
    return f"E={num_experts},H={hidden},I={inter},k={top_k}" + (f",{quant}" if quant else "")


@functools.lru_cache(maxsize=None)
def _tuned(device_name: str) -> dict[str, dict[str, dict[str, dict[str, int]]]]:
    path = Path(__file__).with_name("moe_configs.json")
    return json.loads(path.read_text()).get(device_name, {}) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def moe_configs(num_experts: int, hidden: int, inter: int, top_k: int, tokens: int,
                device_name: str = "", quant: str | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(gate|up pass config, down pass config), both GEMV or both GEMM with one BLOCK_M: what
    benchmarks/scripts/moe_tune.py measured on this GPU for the nearest token count
    (moe_configs.json), else heuristic_config for both. Cached per (E, H, I, k, T, GPU, quant)."""
    table = _tuned(device_name).get(config_key(num_experts, hidden, inter, top_k, quant)) if device_name else None
    if table:
        nearest = min(table, key=lambda t: abs(int(t) - tokens))
        return table[nearest]["up"], table[nearest]["down"]
    cfg = heuristic_config(num_experts, tokens, top_k, quant)
    return cfg, cfg


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def token_bucket(tokens: int) -> int:
    """The config key's token count: the next power of two (so every decode batch size
    and prefill chunk does not get a config of its own)."""
    return triton.next_power_of_2(max(1, tokens))


Experts = torch.Tensor | MXFP4Experts | FP8Experts | IntExperts  # dense [E, N, K] or quantized


class _Operands(NamedTuple):
    """What both passes' kernels take of the weights."""

    n: int  # outputs of the pass (the gate|up pass: I, half of w's rows)
    k: int
    values: torch.Tensor  # dense, packed MXFP4, FP8 or packed integer values
    scales: torch.Tensor  # MXFP4's, FP8's or the integers' scales, or a stand-in
    zeros: torch.Tensor  # the integers' zero points, or a stand-in
    strides: tuple[int, int, int, int, int, int]  # values' expert and row strides, the scales' and zeros' likewise
    kind: int  # the kernels' WEIGHTS
    int_format: dict[str, int]  # the kernels' BITS, GROUP and HAS_ZEROS (stand-ins but for integers)
    config: dict[str, int]  # the tile config as these weights take it
    bias_stride: int
    alpha: float
    limit: float


def _operands(w: Experts, out: torch.Tensor, gated: bool, bias: torch.Tensor | None,
              swiglu: tuple[float, float] | None, config: dict[str, int]) -> _Operands:
    n = w.shape[1] // 2 if gated else w.shape[1]
    cfg = {key: v for key, v in config.items() if key != "GEMV"}
    zeros, int_format = None, {"BITS": 4, "GROUP": 1, "HAS_ZEROS": False}
    if isinstance(w, MXFP4Experts):
        values, scales, kind = w.blocks, w.scales, MXFP4
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], 32)  # a tile spans whole 32-value scale groups
    elif isinstance(w, FP8Experts):
        values, scales, kind = w.weight, w.scale, FP8_BLOCKS if w.blockwise else FP8_ROWS
        row_blocks = (2 if gated else 1) * triton.cdiv(n, FP8_BLOCK)
        if w.blockwise and w.scale.shape[1] != row_blocks:
            raise ValueError(f"FP8 scales {tuple(w.scale.shape)} for {'gate|up ' if gated else ''}weights "
                             f"{tuple(w.shape)}: expected {row_blocks} row blocks"
                             + (" (each half's own, ceil(I / 128) a half)" if gated else ""))
        if w.blockwise:  # a k-tile inside one scale block
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], FP8_BLOCK)
    elif isinstance(w, IntExperts):
        values, scales, zeros, kind = w.qweight, w.scales, w.zeros, INT
        int_format = {"BITS": w.bits, "GROUP": w.group_size, "HAS_ZEROS": w.zeros is not None}
        if w.group_size < w.in_features:  # a k-tile inside one group: the largest power of two dividing it
            tile = w.group_size & -w.group_size
            if tile < 16:
                raise ValueError(f"integer experts in groups of {w.group_size} columns: the fused MoE kernels take "
                                 "groups that are multiples of 16 (or one group a row); load the model with "
                                 "quantization='none'")
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], tile)
    else:
        values, scales, kind = w, out, DENSE
    if bias is not None and (bias.shape != w.shape[:2] or bias.stride(1) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be [E, rows] {tuple(w.shape[:2])} with contiguous rows")
    alpha, limit = swiglu if swiglu is not None else (1.0, 0.0)
    s_strides = (0, 0) if kind == DENSE else (scales.stride(0), scales.stride(1))
    z_strides = (0, 0) if zeros is None else (zeros.stride(0), zeros.stride(1))
    return _Operands(n, w.shape[2], values, scales, scales if zeros is None else zeros,
                     (values.stride(0), values.stride(1), *s_strides, *z_strides), kind, int_format, cfg,
                     bias.stride(0) if bias is not None else 0, float(alpha), float(limit))


def moe_gemm(a: torch.Tensor, w: Experts, out: torch.Tensor, sorted_pairs: torch.Tensor,
             block_expert: torch.Tensor, num_padded: torch.Tensor, weights: torch.Tensor | None, rows_per_a: int,
             gated: bool, config: dict[str, int], bias: torch.Tensor | None = None,
             swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """One pass over the sorted pairs (see the module doc): out [P, N] with N = w.shape[1] // 2
    if gated, else w.shape[1]; a's row for pair p is p // rows_per_a. `w` dense [E, N', K],
    MXFP4Experts, FP8Experts or IntExperts. `bias` [E, w.shape[1]] is added to the expert's rows before the
    activation (gated) or the routing weight; `swiglu` (alpha, limit): gpt-oss's clamped
    activation in place of silu(gate) * up."""
    op = _operands(w, out, gated, bias, swiglu, config)
    blocks = block_expert.numel()
    if blocks == 0 or out.shape[0] == 0:
        return out
    if sorted_pairs.numel() != max_padded_rows(out.shape[0], w.shape[0], op.config["BLOCK_M"]):
        raise ValueError(f"config BLOCK_M {op.config['BLOCK_M']} is not the block size the pairs were aligned to")
    grid = (blocks * triton.cdiv(op.n, op.config["BLOCK_N"]),)
    _moe_gemm_kernel[grid](a, op.values, op.scales, op.zeros, out, sorted_pairs, block_expert, num_padded,
                           weights if weights is not None else out, bias if bias is not None else out, out.shape[0],
                           op.n, op.k, a.stride(0), *op.strides, out.stride(0), op.bias_stride, rows_per_a, op.alpha,
                           op.limit, GATED=gated, WEIGHTED=weights is not None, BIASED=bias is not None,
                           ACTIVATION=0 if swiglu is None else 1, WEIGHTS=op.kind, IEEE=a.dtype == torch.float32,
                           **op.int_format, **op.config)
    return out


def moe_gemv(a: torch.Tensor, w: Experts, out: torch.Tensor, ids: torch.Tensor,
             weights: torch.Tensor | None, rows_per_a: int, gated: bool, config: dict[str, int],
             bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """moe_gemm's pass for few pairs: each pair p (expert ids.flatten()[p]) on its own, no
    sorting and no padded rows (at a decode step of a few tokens most experts see one pair,
    and a 16-row tile would be mostly padding). config: BLOCK_N, BLOCK_K, num_warps, num_stages."""
    op = _operands(w, out, gated, bias, swiglu, config)
    if out.shape[0] == 0:
        return out
    grid = (triton.cdiv(op.n, op.config["BLOCK_N"]), out.shape[0])
    _moe_gemv_kernel[grid](a, op.values, op.scales, op.zeros, out, ids.reshape(-1),
                           weights if weights is not None else out, bias if bias is not None else out, op.n, op.k,
                           a.stride(0), *op.strides, out.stride(0), op.bias_stride, rows_per_a, op.alpha, op.limit,
                           GATED=gated, WEIGHTED=weights is not None, BIASED=bias is not None,
                           ACTIVATION=0 if swiglu is None else 1, WEIGHTS=op.kind, **op.int_format, **op.config)
    return out


def quant_of(w: Experts) -> str | None:
    """The config key's name for the experts' format: None (dense), "mxfp4", "fp8", "int4" or "int8"."""
    if isinstance(w, IntExperts):
        return f"int{w.bits}"
    return "mxfp4" if isinstance(w, MXFP4Experts) else "fp8" if isinstance(w, FP8Experts) else None


def fused_experts(x: torch.Tensor, w13: Experts, w2: Experts, weights: torch.Tensor, ids: torch.Tensor,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """sum over k of weights[t, k] * expert ids[t, k] (x[t]), each expert a SwiGLU MLP with
    w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], dense, MXFP4, FP8 or integers. x [T, H] with
    contiguous rows; weights float32 [T, k]. gpt-oss: `biases` (w13_bias [E, 2I], w2_bias
    [E, H]) and the clamped `swiglu` (alpha, limit); its weight multiplies the expert's output
    after the down bias."""
    tokens, top_k = ids.shape
    experts, two_i, hidden = w13.shape
    inter = two_i // 2
    if tokens == 0:
        return torch.zeros_like(x)
    b13, b2 = biases if biases is not None else (None, None)
    device_name = _device_name(x.device.index or 0) if x.is_cuda else ""
    up_cfg, down_cfg = moe_configs(experts, hidden, inter, top_k, token_bucket(tokens), device_name, quant_of(w13))
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    if up_cfg.get("GEMV"):
        moe_gemv(x, w13, act, ids, None, top_k, True, up_cfg, b13, swiglu)
        moe_gemv(act, w2, out, ids, weights.reshape(-1), 1, False, down_cfg, b2)
    else:
        sorted_pairs, block_expert, num_padded = align_experts(ids, experts, up_cfg["BLOCK_M"])
        moe_gemm(x, w13, act, sorted_pairs, block_expert, num_padded, None, top_k, True, up_cfg, b13, swiglu)
        moe_gemm(act, w2, out, sorted_pairs, block_expert, num_padded, weights.reshape(-1), 1, False, down_cfg, b2)
    return out.view(tokens, top_k, hidden).sum(dim=1)
