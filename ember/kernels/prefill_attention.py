"""Prefill / extend attention over the paged KV cache (varlen): each sequence's new query
tokens attend to its cached prefix and causally to each other. The new K/V are already in
the cache (written by kv_write first), so keys are read from the cache only.

Sequence b, with n = q_len new tokens and P = seq_len - n cached ones:

    q rows      query_start_loc[b] ... query_start_loc[b + 1]   (new tokens, positions P .. P+n-1)
    keys        context positions 0 ........ P-1 | P ..... P+n-1
                                  cached prefix  | new (causal: key p <= query position)

Program (m, h, b) takes query rows [m * BLOCK_M, (m + 1) * BLOCK_M) of sequence b for head
h and walks keys up to its last row's position; rows past n load nothing and store nothing.
With `pack_gqa`, program (m, g, b) takes rows of KV head g's GROUP query heads instead, token
by token (row r: token r // GROUP, head g * GROUP + r % GROUP), so each key tile is read once
for the group: what a decode row needs (deterministic mode sends decode rows here), at no cost
to a prefill. A row's arithmetic is the same in either layout (a tile's rows do not mix).

With a sliding window W (paged.layer_options) the row at position p sees keys
p - W < k <= p, so a program's walk starts at the tile holding its first row's first
visible key; the tiles before it are never read (that is what makes a window fast):

    keys      0 ....... lo ... f ........................ last row's position
              skipped   |      walked, masked per row: p - W < k <= p
    f = max(0, first row's position - W + 1),  lo = f rounded down to BLOCK_N; keys in
    [lo, f) are masked on load, so a key no query of the program sees is never read

Chunked local attention (Llama 4: chunk C; the row at p sees p // C * C <= k <= p) walks
the same way from f = the first row's chunk start; a later row's chunk may start later.

A soft cap (Gemma 2) bends each score before the mask and the softmax (paged.soft_cap).

With `key_ends` (Gemma 3's images: layers/attention/base.py) a row sees keys k < key_ends[row]
in place of k <= its position (an image token: its whole image), and a program walks keys up to
the furthest of its rows' ends; the lower bound (a window's) stays its position's.

A head's D dims are computed on BLOCK_D, D padded to a power of two (kernels/paged.py). The
tiles are BLOCK_M x BLOCK_N = 64 x 64 up to BLOCK_D 256; past it (MLA's 576 -> 1024) they
shrink (`prefill_tiles`) so that q, K, V and the float32 accumulator fit shared memory and
registers: at 1024 tiles of 16 x 16, a quarter of the rows per program, so each KV tile is
read by four times as many programs (and, without pack_gqa, once per query head: MLA's 16 ..
128 heads of one KV head read it 16 .. 128 times).
"""

from __future__ import annotations

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


def prefill_tiles(padded_dim: int, element_size: int = 2) -> tuple[int, int, int | None, int | None]:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for head dims padded to `padded_dim` in elements
    of `element_size` bytes (None: Triton's defaults): 64 x 64 up to 256, then smaller tiles (see
    the top). float32 rows are twice as wide: at 256 dims 64 x 64 in 3 stages asks sm_90 for
    328 KB of its 227 KB of shared memory, 32 x 64 in 2 stages 173 KB; past 1024 bytes a row at the
    larger dims, 16 x 16 (197 KB at 1024 dims where 16 x 32 needs 328 KB)."""
    if padded_dim <= 256:
        return (32, 64, None, 2) if padded_dim * element_size > 512 else (64, 64, None, None)
    return (16, 16, 8, 2) if padded_dim * element_size > 2048 else (16, 32, 8, 2)


# the block-table width changes from step to step outside CUDA graphs: not specialized
# on (a width of 1 or a multiple of 16 would each compile another kernel mid-serving);
# nor the window (paged.layer_options)
@triton.jit(do_not_specialize=["stride_tb", "window", "first_seq"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, tables_ptr, query_start_ptr, seq_lens_ptr, k_scale_ptr,
                    v_scale_ptr, sinks_ptr, key_ends_ptr, scale_log2, window, softcap, first_seq, stride_qt, stride_qh, stride_ot,
                    stride_oh, stride_tb,
                    stride_cb, stride_cs, stride_ch, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                    DOT_FP16: tl.constexpr, SLIDING: tl.constexpr, CHUNKED: tl.constexpr, SOFTCAP: tl.constexpr, PACK_GQA: tl.constexpr,
                    SHARED_KV: tl.constexpr, SINKS: tl.constexpr, KEY_ENDS: tl.constexpr):
    mb = tl.program_id(0)
    b = tl.program_id(2) + first_seq
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    if PACK_GQA:  # program (mb, kv head): rows (token, head) of the KV head's GROUP heads, token-major
        kvh = tl.program_id(1)
        tok = r // GROUP
        head = kvh * GROUP + r % GROUP
        first_tok = mb * BLOCK_M // GROUP
        tile_toks = (mb * BLOCK_M + BLOCK_M - 1) // GROUP - first_tok + 1
    else:  # program (mb, head): BLOCK_M tokens of one head
        head = tl.program_id(1)
        kvh = head // GROUP
        tok = r
        first_tok = mb * BLOCK_M
        tile_toks = BLOCK_M
    rmask = tok < q_len
    q_pos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    qo_mask = tile_mask(rmask, d, D, BLOCK_D)
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=qo_mask, other=0.0)
    if FP8:  # the cache holds K / k_scale and V / v_scale (see paged.py)
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    q = queries_for_dot(q, DOT_FP16)
    # keys up to the block's last query position; nothing for a block past the new tokens
    toks_here = tl.maximum(tl.minimum(q_len - first_tok, tile_toks), 0)
    end = tl.minimum(prefix + first_tok + toks_here, toks_here * seq_len)
    if KEY_ENDS:  # each row's own end of keys; the walk reaches the furthest (rows past the tokens: 0)
        row_end = tl.load(key_ends_ptr + q_start + tok, mask=rmask, other=0)
        end = tl.maximum(end, tl.max(row_end, 0))

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if SLIDING or CHUNKED:  # from the tile holding the block's first row's first visible key f (see the top)
        if SLIDING:
            first = tl.maximum(prefix + first_tok - window + 1, 0)
        else:
            first = (prefix + first_tok) // window * window
        lo = first // BLOCK_N * BLOCK_N
    else:
        lo = 0
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        if SLIDING or CHUNKED:  # no row sees a key before f: not read at all
            pmask = pmask & (pos >= first)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, tables_ptr + b * stride_tb, n0, pmask, kvh, d,
                            stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, D, BLOCK_D, SHARED_KV)
        qk = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
        if SOFTCAP:
            qk = soft_cap(qk, softcap)
        if KEY_ENDS:
            visible = pmask[None, :] & (pos[None, :] < row_end[:, None])
        else:
            visible = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:  # a row may see nothing in a tile before its own first key: m_safe covers it
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        if CHUNKED:  # nor before its own chunk's first key
            visible = visible & (pos[None, :] >= q_pos[:, None] // window * window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row that sees nothing yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new

    if SINKS:  # each row's head's sink joins the denominator
        m, l, acc = add_sink(m, l, acc, tl.load(sinks_ptr + head))
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(o_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qo_mask)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                      out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      sliding_window: int | None = None, logit_softcap: float | None = None,
                      pack_gqa: bool = False, first_seq: int = 0, num_warps: int | None = None,
                      num_stages: int | None = None, sinks: torch.Tensor | None = None,
                      attention_chunk: int | None = None, key_ends: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] flattened new tokens (any D >= 8), caches [num_blocks, block_size, Hkv, D]
    holding every sequence's context (new tokens included) in q's dtype or fp8 (then k_scale /
    v_scale: [1] float32, None: 1.0; k_cache may be v_cache: MLA's one plane), block_tables
    [B, W] int32, query_start_loc [B + 1] int32, seq_lens [B] int32; sliding_window /
    logit_softcap / sinks ([H] float32) / attention_chunk / key_ends ([T] int32, each within
    its row's sequence length) as in layers/attention/base.py.
    pack_gqa: a program takes the rows of all the query heads of one KV head (see the top).
    first_seq: attend sequences first_seq .. B-1 only (their rows of `out`; a mixed step's
    leading decode rows go to flash-decoding), by an offset rather than sliced tensors, whose
    unaligned pointers would compile another kernel variant mid-serving.
    block_m / block_n / num_warps / num_stages: None takes prefill_tiles' (Triton's defaults
    where that gives None). Returns [T, H, D]."""
    tokens, heads, dim = q.shape
    num_blocks, page, kv_heads, cdim = k_cache.shape
    batch = seq_lens.shape[0]
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
    if query_start_loc.shape != (batch + 1,) or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"query_start_loc must be [{batch + 1}] and block_tables [{batch}, W] with contiguous rows; "
                         f"got {tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}")
    if any(t.dtype != torch.int32 for t in (block_tables, query_start_loc, seq_lens)):
        raise ValueError("block_tables, query_start_loc and seq_lens must be int32")
    if key_ends is not None and (key_ends.shape != (tokens,) or key_ends.dtype != torch.int32):
        raise ValueError(f"key_ends must be int32 [{tokens}] (one a query row), got {tuple(key_ends.shape)} "
                         f"{key_ends.dtype}")
    check_head_dim(dim)
    out = torch.empty_like(q) if out is None else out
    if tokens == 0:
        return out
    if not 0 <= first_seq < batch:
        raise ValueError(f"first_seq must be in [0, {batch}); got {first_seq}")
    group = heads // kv_heads
    padded = block_d(dim)
    tiles = prefill_tiles(padded, q.element_size())
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    launch = {k: v for k, v in dict(num_warps=num_warps or tiles[2], num_stages=num_stages or tiles[3]).items() if v}
    grid = (triton.cdiv(max_query_len * group, block_m), kv_heads, batch - first_seq) if pack_gqa else \
        (triton.cdiv(max_query_len, block_m), heads, batch - first_seq)
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, k_scale, v_scale,
                          sinks_arg(sinks, heads, q), q if key_ends is None else key_ends, scale * LOG2E, window, softcap, first_seq, q.stride(0), q.stride(1), out.stride(0),
                          out.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          GROUP=group, D=dim, BLOCK_D=padded, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page, FP8=fp8,
                          DOT_FP16=dot_in_fp16(q, k_cache), PACK_GQA=pack_gqa, SHARED_KV=shared_kv(k_cache, v_cache),
                          SINKS=sinks is not None, KEY_ENDS=key_ends is not None,
                          **launch, **options)
    return out
