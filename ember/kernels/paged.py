"""What the attention kernels share: reading a tile of K and V out of the paged cache, the
fp8 cache's scales, the per-layer options (sliding window, logit soft-capping), and the
head dim's padding.

Context position p of a sequence is at cache[table_row[p // PAGE], p % PAGE, kv_head].

A head has D dims, any D >= 8 (Phi-2's 80, Phi-3-mini's 96, multi-head latent attention's
576); a kernel computes on BLOCK_D = max(16, next_power_of_2(D)) of them (`block_d`): the
dims past D load as 0 (so they add nothing to q.k, and their output columns are 0) and are
never stored, while strides and offsets keep the real D. Where BLOCK_D == D (a power of two
>= 16) the d mask is not built at all (`tile_mask`): such a D compiles to the code it had
before. The padding costs what it pads: D 576 computes (and holds in registers) 1024 columns,
1.8x the dots and the accumulator of the real dims, though the bytes read stay D's (masked
loads); see decode_attention.py and prefill_attention.py for the tiles taken at large D.

When a layer's k_cache is its v_cache (MLA: one latent plane, a value row is its key row),
the kernels load each tile once (SHARED_KV).

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

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
FP16_MAX = tl.constexpr(65504.0)
TWO_LOG2E = tl.constexpr(2 * LOG2E)

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


MIN_HEAD_DIM = 8


def block_d(dim: int) -> int:
    """The d axis a kernel computes on for head dim `dim`: a power of two (tl.arange), at
    least 16 (tl.dot's least K)."""
    return max(16, triton.next_power_of_2(dim))


def check_head_dim(dim: int) -> None:
    if dim < MIN_HEAD_DIM:
        raise ValueError(f"head_dim must be at least {MIN_HEAD_DIM} (padded to a power of two >= 16 inside the "
                         f"kernels), got {dim}")


def shared_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the layer's k_cache is its v_cache (MLA's one plane): a tile is then loaded once."""
    return k_cache.data_ptr() == v_cache.data_ptr() and k_cache.stride() == v_cache.stride()


@triton.jit
def tile_mask(rmask, d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The mask of a [R, BLOCK_D] tile whose rows are masked by `rmask` [R]: where BLOCK_D
    pads D, the columns d >= D too (loaded as 0, never stored). A power-of-two D
    (BLOCK_D == D) builds no column compare: rmask[:, None], as before D was padded."""
    mask = rmask[:, None]
    if BLOCK_D != D:
        mask = mask & (d < D)[None, :]
    return mask


@triton.jit
def tile_rows(table_row_ptr, n0, pmask, stride_cb, stride_cs, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cache offsets (int64, [BLOCK_N]) of context positions n0 ... n0 + BLOCK_N - 1 (n0 a
    multiple of BLOCK_N; masked by `pmask`) at KV head 0. Where a page holds whole tiles (PAGE
    a multiple of BLOCK_N) one block-table read serves the tile (see load_kv_tile)."""
    if PAGE % BLOCK_N == 0:
        block = tl.load(table_row_ptr + n0 // PAGE).to(tl.int64)
        return block * stride_cb + (n0 % PAGE + tl.arange(0, BLOCK_N)) * stride_cs
    pos = n0 + tl.arange(0, BLOCK_N)
    block = tl.load(table_row_ptr + pos // PAGE, mask=pmask, other=0)
    return block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_row_ptr, n0, pmask, kvh, d, stride_cb, stride_cs, stride_ch,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 SHARED_KV: tl.constexpr):
    """K and V of KV head `kvh` at context positions n0 ... n0 + BLOCK_N - 1 (n0 a multiple
    of BLOCK_N; masked by `pmask`): [BLOCK_N, BLOCK_D] each (d = arange(BLOCK_D)), 0 where
    masked and in the padded dims d >= D, in the cache's dtype. With SHARED_KV (k_cache is
    v_cache) the tile is loaded once and returned as both.
    `table_row_ptr` points at the sequence's block-table row. Where a page holds whole tiles
    (PAGE a multiple of BLOCK_N: CUDA's default block size of 128), one block-table read
    serves the tile and its rows are at one base: the fp8 decode kernel read 16-20 % faster
    so on the H200 than with a read per position (the KV layout probe of BENCHMARKS.md)."""
    off = tile_rows(table_row_ptr, n0, pmask, stride_cb, stride_cs, PAGE, BLOCK_N) + kvh * stride_ch
    mask = tile_mask(pmask, d, D, BLOCK_D)
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    if SHARED_KV:
        v = k
    else:
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


def sinks_arg(sinks: torch.Tensor | None, heads: int, q: torch.Tensor) -> torch.Tensor:
    """A layer's attention sinks (gpt-oss: a logit a query head) as the kernels read them: float32
    [heads], times log2(e); without sinks a stand-in pointer the kernels never read (SINKS false)."""
    if sinks is None:
        return q
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must be [{heads}] (one logit a query head), got {tuple(sinks.shape)}")
    return (sinks.float() * LOG2E).contiguous()  # in the kernels' log2 domain


@triton.jit
def add_sink(m, l, acc, sink_log2):
    """An online softmax's state (running max m, sum l, numerator acc; log2 domain) with one more
    term of the denominator, exp2(sink - max), and no value (gpt-oss's attention sinks)."""
    m_new = tl.maximum(m, sink_log2)
    alpha = tl.exp2(m - m_new)
    return m_new, l * alpha + tl.exp2(sink_log2 - m_new), acc * alpha[:, None]


def layer_options(sliding_window: int | None, logit_softcap: float | None,
                  attention_chunk: int | None = None) -> dict:
    """A layer's options (base.py) as the attention kernels take them: constexpr flags, so
    that a layer without them compiles to the very code it had before they existed, and
    their values as runtime arguments (one compiled kernel whatever the window):

        SLIDING, window     W: a query at p sees keys p - W < k <= p   (off: 0)
        CHUNKED, window     C: a query at p sees keys p // C * C <= k <= p (Llama 4's chunked
                            local attention; `window` carries C, a layer has one or the other)
        SOFTCAP, softcap    the cap c times log2(e), in the kernels' log2 domain  (off: 0.0)

    Each kernel lists `window` in do_not_specialize: Triton would otherwise compile one
    variant for W divisible by 16 and one for W == 1."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if attention_chunk is not None and (isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int)
                                        or attention_chunk < 1 or sliding_window is not None):
        raise ValueError(f"attention_chunk must be a positive int or None, and not beside a sliding window; got "
                         f"{attention_chunk!r} with sliding_window {sliding_window!r}")
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float))
                                      or not 0 < logit_softcap < math.inf):
        raise ValueError(f"logit_softcap must be a positive finite number or None, got {logit_softcap!r}")
    return dict(window=sliding_window or attention_chunk or 0, softcap=float(logit_softcap or 0.0) * LOG2E,
                SLIDING=sliding_window is not None, CHUNKED=attention_chunk is not None,
                SOFTCAP=logit_softcap is not None)


@triton.jit
def soft_cap(qk, cap):
    """cap * tanh(qk / cap), in float32. The kernels hold scores in the log2 domain,
    qk = log2(e) * s with s = scale * q.k the natural score; capping there with the cap
    times log2(e) is the natural cap converted after: log2(e) * c * tanh(s / c) =
    (log2(e) * c) * tanh((log2(e) * s) / (log2(e) * c)). An fp8 cache's k_scale is inside
    qk already. tanh through exp2 (the interpreter has no libdevice): for u = |x|,
    tanh(u) = (1 - e^-2u) / (1 + e^-2u), with e^-2u in (0, 1] so nothing overflows; the
    absolute error is a few float32 ulps of 1."""
    x = qk * (TWO_LOG2E / cap)  # 2 * log2(e) * s / c
    t = tl.exp2(-tl.abs(x))  # e^(-2 |s / c|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y) * cap
