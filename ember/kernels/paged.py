"""What the attention kernels share: reading a tile of K and V out of the paged cache, and
the fp8 cache's scales.

Context position p of a sequence is at cache[table_row[p // PAGE], p % PAGE, kv_head].

An fp8 cache (float8_e4m3fn) holds x / scale, with one scale per tensor (k_scale, v_scale:
[1] float32 on the device, 1.0 unless calibrated). A kernel loads the fp8 tile, converts it
to the compute dtype (exact: every e4m3 value is a bfloat16), and applies the scales where
it is cheapest: k_scale in the softmax scale, v_scale on the output. With bfloat16 queries
the dots then run in float16 (DOT_FP16): e4m3 -> float16 is one cvt.rn.f16x2.e4m3x2 per
two values, e4m3 -> bfloat16 three instructions, which made an fp8 decode step slower than
a bfloat16 one on the H200 (conversion-bound at 1.8 TB/s). Every e4m3 value and every
probability is a float16; queries are clamped to float16's range (+-65504) first. With it,
at the Qwen3-0.6B benchmark shape: 245 us against bfloat16's 276 us (2.2 TB/s of fp8, so
still not memory-bound: the tiles go through registers for the conversion)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
FP16_MAX = tl.constexpr(65504.0)

_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def dot_in_fp16(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether a kernel computes its dots in float16: bfloat16 queries over an fp8 cache."""
    return is_fp8(cache) and q.dtype == torch.bfloat16


def kv_scale_arg(scale: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The scale pointer a kernel takes: for an fp8 cache `scale` ([1] float32 on the cache's
    device), or 1.0 when None; for any other cache a placeholder the kernel never reads."""
    if not is_fp8(cache):
        return cache
    if scale is None:
        if cache.device not in _UNIT_SCALES:
            _UNIT_SCALES[cache.device] = torch.ones(1, dtype=torch.float32, device=cache.device)
        return _UNIT_SCALES[cache.device]
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != cache.device:
        raise ValueError(f"an fp8 cache's scale must be one float32 on {cache.device}; got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")
    return scale


@triton.jit
def queries_for_dot(q, DOT_FP16: tl.constexpr):
    """q as the dots take it: float16 (clamped to its range) with DOT_FP16, else as it is."""
    if DOT_FP16:
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    return q


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_row_ptr, pos, pmask, kvh, d, stride_cb, stride_cs, stride_ch,
                 PAGE: tl.constexpr):
    """K and V of KV head `kvh` at context positions `pos` ([N], masked by `pmask`): [N, D]
    each, 0 where masked, in the cache's dtype. `table_row_ptr` points at the sequence's
    block-table row."""
    block = tl.load(table_row_ptr + pos // PAGE, mask=pmask, other=0)
    off = block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
    return k, v


@triton.jit
def kv_offsets(table_row_ptr, n0, end, kvh, stride_cb, stride_cs, stride_ch, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGE_IDS: tl.constexpr, OFF32: tl.constexpr):
    """Element offsets [BLOCK_N] into a cache of the positions n0 + [0, BLOCK_N) of KV head
    `kvh` (0 for those >= end). PAGE_IDS: read the block table once per page (n0 and
    BLOCK_N multiples of PAGE, a power of two) instead of once per position. OFF32: in
    int32 (the caller knows that every offset fits), else int64."""
    if PAGE_IDS:
        page = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
        block = tl.load(table_row_ptr + page, mask=page * PAGE < end, other=0)
        slot = tl.arange(0, PAGE)
        if OFF32:
            off = block[:, None] * stride_cb + slot[None, :] * stride_cs
        else:
            off = block.to(tl.int64)[:, None] * stride_cb + slot[None, :] * stride_cs
        off = tl.reshape(off, [BLOCK_N])
    else:
        pos = n0 + tl.arange(0, BLOCK_N)
        block = tl.load(table_row_ptr + pos // PAGE, mask=pos < end, other=0)
        if OFF32:
            off = block * stride_cb + (pos % PAGE) * stride_cs
        else:
            off = block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs
    return off + kvh * stride_ch


@triton.jit
def load_rows(cache_ptr, off, pmask, d, TRANSPOSED: tl.constexpr):
    """The cache rows at element offsets `off` ([N], masked by `pmask`, 0 there): [N, D], or
    [D, N] with TRANSPOSED (the same bytes, addressed transposed), in the cache's dtype."""
    if TRANSPOSED:
        return tl.load(cache_ptr + off[None, :] + d[:, None], mask=pmask[None, :], other=0.0)
    return tl.load(cache_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)


@triton.jit
def in_registers(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] unchanged, through a split of adjacent column pairs and a join back: a
    shape change the compiler does not move a later layout change (to a dot operand's,
    through shared memory) across, so the conversion that made x stays in x's load layout.
    For an fp8 V tile: read from shared memory in vectors and converted there, then
    transposed in 16 bits (ldmatrix.trans) instead of read byte by byte."""
    a, b = tl.split(tl.reshape(x, [ROWS, COLS // 2, 2]))
    return tl.reshape(tl.join(a, b), [ROWS, COLS])
