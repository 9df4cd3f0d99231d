"""Decode attention over the paged KV cache: one new query token per sequence, split along
the context (flash-decoding) so that a small batch still fills the GPU.

Stage 1: program (b, kv_head, s) takes split s of sequence b's context,

    context  [0 ............................................ seq_len)
    splits   [0, L) [L, 2L) ... [(S-1)L, seq_len)      L = cdiv(seq_len, S) rounded up to BLOCK_N

and attends the GROUP query heads that share kv_head (GQA, padded to BLOCK_H >= 16 rows
for tl.dot) over it: a partial output and its log-sum-exp. A split past the context writes
lse = -inf. Stage 2 merges the S partials of each (b, head). With S == 1 stage 1 writes
the output itself.

A head's D dims are computed on BLOCK_D, D padded to a power of two (kernels/paged.py). Where
a program's BLOCK_H x BLOCK_D accumulator would pass MAX_ACC elements (MLA: 16 .. 128 heads
of D 576 -> BLOCK_D 1024 over one KV head), the group's heads are cut into HEAD_BLOCKS
blocks of BLOCK_H, one program each, over the same split: programs (b, kv_head x head block,
s). Each head block reads the split's KV tiles again (from L2 at best): at MLA's 128 heads,
8 reads (the Triton backend sends a model's MLA decode rows to kernels/mla_decode.py instead:
no padding, four reads at 128 heads). Past BLOCK_D 256 the tiles get fewer rows
(`decode_config`), so that K and V fit shared memory and registers.

With a sliding window W the query (at position seq_len - 1) sees keys seq_len - W ..
seq_len - 1, and the splits cover only those, from the tile that holds the first; the tiles
before it are never read (that is what makes a window fast):

    context  [0 ......... lo .. f ........................................ seq_len)
    splits                [lo, lo + L) [lo + L, lo + 2L) ... [lo + (S-1)L, seq_len)
    f = max(0, seq_len - W),  lo = f rounded down to BLOCK_N,
    L = cdiv(seq_len - lo, S) rounded up to BLOCK_N; keys in [lo, f) are masked on load

Chunked local attention (Llama 4: chunk C) is the same walk from f = (seq_len - 1) // C * C,
the first key of the query's chunk.

A soft cap (Gemma 2) bends each score before the softmax (paged.soft_cap).

The key at context position p is at k_cache[block_tables[b, p // block_size], p % block_size].
Everything the kernels read is on the GPU (no host lengths), so a CUDA graph replays them.
An fp8 cache is read as kernels/paged.py says: k_scale folds into the softmax scale, v_scale
multiplies the split's output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.paged import (
    LOG2E,
    add_sink,
    block_d,
    check_head_dim,
    dot_in_fp16,
    is_fp8,
    kv_scale_arg,
    layer_options,
    load_kv_tile,
    queries_for_dot,
    shared_kv,
    sinks_arg,
    soft_cap,
    tile_mask,
)

# BLOCK_N, num_warps, num_stages of the split kernel by cache dtype, from
# benchmarks/scripts/decode_sweep.py on the H200: bfloat16 3.99 / 4.37 TB/s of KV at the
# Qwen3-0.6B / Llama-8B benchmark shapes; fp8 at 128-token pages 2.69 TB/s against 2.48 for
# bfloat16's config, and +6 % on the nano-vllm run (two warps and five stages: smaller
# programs, more of them resident an SM). EMBER_DECODE_CONFIG="64,4,3" overrides both, for sweeps.
_OVERRIDE = os.environ.get("EMBER_DECODE_CONFIG")
DECODE_CONFIG = tuple(int(x) for x in (_OVERRIDE or "128,4,4").split(","))
DECODE_CONFIG_FP8 = tuple(int(x) for x in (_OVERRIDE or "64,2,5").split(","))
MAX_ACC = 16 * 1024  # the most elements of a program's float32 accumulator, BLOCK_H x BLOCK_D (see the top)


def decode_config(fp8: bool, padded_dim: int, element_size: int = 2) -> tuple[int, int, int]:
    """BLOCK_N, num_warps, num_stages for a cache of head dim padded to `padded_dim` in elements of
    `element_size` bytes: the tuned configs above up to 256 (Gemma's heads); past it tiles of 32K
    elements (32 rows at MLA's 1024) over eight warps, which the tuned configs' 128 x 1024 tiles
    would overflow (shared memory) and four warps spill (registers). A float32 cache's rows are
    twice as wide, so its tiles hold half the rows (at 256 dims 128 rows asked sm_90 for 281 KB of
    its 227; 64 rows 149 KB)."""
    config = DECODE_CONFIG_FP8 if fp8 else DECODE_CONFIG
    if _OVERRIDE:
        return config
    tile = 32 * 1024 * 2 // max(2, element_size)  # elements of a K tile: 64 KB
    if padded_dim <= 256:
        return min(config[0], max(16, tile // padded_dim)), config[1], config[2]
    return max(16, tile // padded_dim), 8, 3


def head_blocks(group: int, padded_dim: int) -> tuple[int, int]:
    """(BLOCK_H, HEAD_BLOCKS): the group's heads padded to BLOCK_H >= 16 rows, in HEAD_BLOCKS
    programs where one would hold more than MAX_ACC accumulator elements."""
    block_h = max(16, triton.next_power_of_2(group))
    while block_h > 16 and block_h * padded_dim > MAX_ACC:
        block_h //= 2
    return block_h, triton.cdiv(group, block_h)


# the block-table width changes from step to step outside CUDA graphs: not specialized
# on (a width of 1 or a multiple of 16 would each compile another kernel mid-serving);
# nor the window (paged.layer_options)
@triton.jit(do_not_specialize=["stride_tb", "window"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, o_ptr, lse_ptr,
                         k_scale_ptr, v_scale_ptr, sinks_ptr, scale_log2, window, softcap, stride_qt, stride_qh, stride_tb,
                         stride_cb, stride_cs, stride_ch, stride_ob, stride_oh, stride_os,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         FP8: tl.constexpr, DOT_FP16: tl.constexpr, SLIDING: tl.constexpr, CHUNKED: tl.constexpr,
                         SOFTCAP: tl.constexpr, SHARED_KV: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    if HEAD_BLOCKS == 1:  # the KV head's whole group in one program
        kvh = tl.program_id(1)
    else:  # head block program_id(1) % HEAD_BLOCKS of the group (see the top)
        kvh = tl.program_id(1) // HEAD_BLOCKS
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if SLIDING or CHUNKED:  # the splits cover [lo, seq_len) only (see the top)
        if SLIDING:
            first = tl.maximum(seq_len - window, 0)
        else:  # the query's chunk starts there
            first = tl.maximum(seq_len - 1, 0) // window * window
        lo = first // BLOCK_N * BLOCK_N
        split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + s * split_len
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    if HEAD_BLOCKS > 1:
        rows += tl.program_id(1) % HEAD_BLOCKS * BLOCK_H
    heads = kvh * GROUP + rows
    hmask = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    qo_mask = tile_mask(hmask, d, D, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    if FP8:  # the cache holds K / k_scale and V / v_scale: q.K = k_scale * (q.(K / k_scale))
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    q = queries_for_dot(q, DOT_FP16)  # the dots' dtype: q's, or float16 over fp8 (see paged.py)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        if SLIDING or CHUNKED:  # keys in [lo, first) are not read; every walked tile holds a visible key
            pmask = pmask & (pos >= first)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, tables_ptr + b * stride_tb, n0, pmask, kvh, d,
                            stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, D, BLOCK_D, SHARED_KV)
        qk = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2  # [BLOCK_H, BLOCK_N], log2 domain
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        qk = tl.where(pmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new

    if SINKS and NUM_SPLITS == 1:  # the head's sink joins the denominator (the merge adds it over splits)
        m, l, acc = add_sink(m, l, acc, tl.load(sinks_ptr + heads, mask=hmask, other=0.0))
    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    o_off = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=qo_mask)
    else:
        tl.store(o_ptr + o_off + s * stride_os, out, mask=qo_mask)
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        if HEAD_BLOCKS == 1:
            num_heads = GROUP * tl.num_programs(1)
        else:
            num_heads = GROUP * (tl.num_programs(1) // HEAD_BLOCKS)
        tl.store(lse_ptr + (b * num_heads + heads) * NUM_SPLITS + s, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(part_ptr, lse_ptr, o_ptr, sinks_ptr, stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + (b * NUM_HEADS + h) * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    if SINKS:  # the head's sink: one more term of the denominator, of no value
        sink = tl.load(sinks_ptr + h)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (graph padding): output 0
    w = tl.exp2(lse - top)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    d = tl.arange(0, BLOCK_D)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=tile_mask(smask, d, D, BLOCK_D), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(total, 1e-30)
    if BLOCK_D == D:
        tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))
    else:  # the padded dims are not the output's
        tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


def num_decode_splits(batch: int, num_kv_heads: int, max_splits: int = 32, target_programs: int = 528) -> int:
    """Enough splits that batch x kv_heads x splits fills the GPU (~4 programs per SM of
    an H200's 132); a function of the batch size alone, so a CUDA graph fixes it. A power
    of two: few kernel variants to compile."""
    want = min(max_splits, -(-target_programs // (batch * num_kv_heads)))
    return 1 << max(0, want - 1).bit_length()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int, out: torch.Tensor | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence; any D >= 8), caches [num_blocks, block_size, Hkv, D]
    in q's dtype or fp8 (then k_scale / v_scale: [1] float32, None: 1.0; k_cache may be
    v_cache: MLA's one plane), block_tables
    [B, >= cdiv(max seq_len, block_size)] int32, seq_lens [B] int32 (0: no context,
    output 0); sliding_window / logit_softcap / sinks ([H] float32) / attention_chunk as in
    layers/attention/base.py.
    Returns [B, H, D]."""
    batch, heads, dim = q.shape
    num_blocks, page, kv_heads, cdim = k_cache.shape
    fp8 = is_fp8(k_cache)
    if cdim != dim or heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype \
            or (k_cache.dtype != q.dtype and not fp8):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(k_cache.shape)} {k_cache.dtype} "
                         f"/ {tuple(v_cache.shape)} {v_cache.dtype}")
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q's last dim and the caches must be contiguous")
    k_scale, v_scale = kv_scale_arg(k_scale, k_cache), kv_scale_arg(v_scale, v_cache)
    options = layer_options(sliding_window, logit_softcap, attention_chunk)
    window, softcap = options.pop("window"), options.pop("softcap")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,) or block_tables.dtype != torch.int32 \
            or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables must be [{batch}, W] int32 and seq_lens [{batch}] int32; got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}, {tuple(seq_lens.shape)} {seq_lens.dtype}")
    check_head_dim(dim)
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    padded = block_d(dim)
    block_h, num_head_blocks = head_blocks(group, padded)
    grid = (batch, kv_heads * num_head_blocks, num_splits)
    config = decode_config(fp8, padded, k_cache.element_size())
    common = dict(GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=num_head_blocks, D=dim, BLOCK_D=padded,
                  BLOCK_N=block_n or config[0], PAGE=page, NUM_SPLITS=num_splits, FP8=fp8,
                  DOT_FP16=dot_in_fp16(q, k_cache), SHARED_KV=shared_kv(k_cache, v_cache), SINKS=sinks is not None,
                  num_warps=num_warps or config[1], num_stages=num_stages or config[2], **options)
    scale_log2 = scale * LOG2E
    sink_arg = sinks_arg(sinks, heads, q)
    if num_splits == 1:
        _decode_split_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, out, out, k_scale, v_scale, sink_arg,
                                   scale_log2,
                                   window, softcap, q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0),
                                   k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), 0,
                                   **common)
        return out
    part = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, part, lse, k_scale, v_scale, sink_arg,
                               scale_log2,
                               window, softcap, q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0),
                               k_cache.stride(1), k_cache.stride(2), part.stride(0), part.stride(1),
                               part.stride(2), **common)
    _decode_merge_kernel[(batch, heads)](part, lse, out, sink_arg, part.stride(0), part.stride(1), part.stride(2),
                                         out.stride(0), out.stride(1), NUM_HEADS=heads, D=dim, BLOCK_D=padded,
                                         NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                                         SINKS=sinks is not None)
    return out
