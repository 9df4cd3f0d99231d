"""What the attention kernels share: reading a tile of K and V out of the paged cache.

Context position p of a sequence is at cache[table_row[p // PAGE], p % PAGE, kv_head]."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_row_ptr, pos, pmask, kvh, d, stride_cb, stride_cs, stride_ch,
                 PAGE: tl.constexpr):
    """K and V of KV head `kvh` at context positions `pos` ([N], masked by `pmask`): [N, D]
    each, 0 where masked. `table_row_ptr` points at the sequence's block-table row."""
    block = tl.load(table_row_ptr + pos // PAGE, mask=pmask, other=0)
    off = block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=pmask[:, None], other=0.0)
    return k, v
