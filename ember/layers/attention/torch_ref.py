"""Plain-torch paged attention: runs anywhere and is the oracle for the other backends.
On the CPU every row goes to one C++ kernel that reads the paged cache in place
(`ember/kernels/cpu/paged_attention.cpp`) where that kernel could be built: decode,
prefill and a chunk over its cached prefix alike, in one order of arithmetic per row, so
a row's output does not depend on how its step was batched or its prompt cut.

Plain torch plans once a step (which cache slots each sequence reads, which keys each
query may see) and every layer reuses the plan. Sequences with one new token (decode) run
as one padded batch; so do those with a few new tokens (up to SHORT_CHUNK: tokens that
structured output's jump-forward appended, the tail of a chunked prompt); each sequence
with more (prefill, chunked prefill over a cached prefix) runs on its own.

An fp8 cache is quantized on write and dequantized (to float32) on read, as base.py says;
the Triton kernels must match this bit for bit on write and closely on read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ember.kernels import cpu as cpu_kernels
from ember.layers.attention.base import AttentionBackend, AttentionMetadata

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What a cache of `cache_dtype` stores for x: x itself, or for fp8 x / scale clamped to
    the e4m3 range (the cast rounds to nearest even)."""
    if cache_dtype != FP8:
        return x.to(cache_dtype)
    x = x.float() if scale is None else x.float() / scale
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache contents back in a compute dtype: fp8 times its scale, in float32; others as they are."""
    if x.dtype != FP8:
        return x
    return x.float() if scale is None else x.float() * scale


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows, flat = quantize_kv(x, cache.dtype, scale), cache.view(-1, num_kv_heads, head_dim)
        if cache.dtype == FP8:  # index_copy_ has no float8 kernel: copy the bytes
            rows, flat = rows.view(torch.uint8), flat.view(torch.uint8)
        flat.index_copy_(0, slot_mapping, rows)


def context_blocks(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[num_seqs, L, kv_heads, head_dim], L >= length rounded up to whole blocks: each
    sequence's cached tokens in order (past a sequence's own length, whatever its padded
    table points at: callers mask it). Gathering whole blocks beats gathering tokens."""
    block_size = cache.shape[1]
    tables = block_tables[:, : -(-length // block_size)].long()
    return cache[tables].flatten(1, 2)


SHORT_CHUNK = 16  # sequences with 2..SHORT_CHUNK new tokens share one padded batch


@dataclass
class _Group:
    tokens: torch.Tensor | slice  # which rows of q this group answers
    tables: torch.Tensor  # [B, max_blocks] the sequences' block tables
    mask: torch.Tensor  # [B, 1, n, L] True where a query may see a key


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_written: bool = False, sliding_window: int | None = None,
                logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None, value_dim: int | None = None) -> torch.Tensor:
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta, k_scale, v_scale)
        out = self._attend_all(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window, logit_softcap,
                               sinks, attention_chunk)
        return out if value_dim is None else out[..., :value_dim]  # MLA: the weighted latents, not their k_pe

    def _attend_all(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale, v_scale,
                    sliding_window: int | None, logit_softcap: float | None,
                    sinks: torch.Tensor | None, attention_chunk: int | None) -> torch.Tensor:
        if _cpu_kernel_ok(q):
            return cpu_kernels.ops().paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                                     meta.seq_lens, scale, sliding_window or 0, logit_softcap or 0.0,
                                                     k_scale, v_scale, None if sinks is None else sinks.float(),
                                                     attention_chunk or 0, meta.key_ends)
        seen = _Seen(sliding_window, attention_chunk)
        key = (self.name, seen)  # layers that see other keys: their own plan
        groups = meta.plans.get(key)
        if groups is None:
            groups = meta.plans[key] = _plan(meta, k_cache.shape[1], seen)
        scales = (k_scale, v_scale)
        if len(groups) == 1 and isinstance(groups[0].tokens, slice) and groups[0].tokens == slice(None):
            return self._attend(q, k_cache, v_cache, groups[0], scale, scales, sliding_window, logit_softcap, sinks)
        out = torch.empty_like(q)
        for g in groups:
            out[g.tokens] = self._attend(q[g.tokens], k_cache, v_cache, g, scale, scales, sliding_window,
                                         logit_softcap, sinks)
        return out

    @staticmethod
    def _attend(q, k_cache, v_cache, g: _Group, scale: float, kv_scales, sliding_window: int | None,
                logit_softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q rows of B sequences: [B * n, H, D] -> [B * n, H, D]."""
        batch, n, length = g.tables.shape[0], g.mask.shape[2], g.mask.shape[3]
        keys = dequantize_kv(context_blocks(k_cache, g.tables, length), kv_scales[0])  # [B, L, Hkv, D]
        values = dequantize_kv(context_blocks(v_cache, g.tables, length), kv_scales[1])
        if logit_softcap is not None or sinks is not None or (n == 1 and q.dtype != torch.float32):
            # measured at batch 16: for a bfloat16 cache two small float32 matmuls beat
            # upcasting everything for SDPA; in float32, SDPA's kernel is the faster one.
            # SDPA has no soft-capping or sinks: those take the matmuls too.
            return _matmul_attention(q.view(batch, n, *q.shape[1:]), keys, values, g.mask, scale,
                                     logit_softcap, sinks).reshape(q.shape)
        # in float32: torch's CPU attention is much slower in bfloat16, and these are small
        o = F.scaled_dot_product_attention(
            q.view(batch, n, *q.shape[1:]).transpose(1, 2).float(), keys.transpose(1, 2).float(),
            values.transpose(1, 2).float(), attn_mask=g.mask, scale=scale, enable_gqa=True,
        )
        return o.transpose(1, 2).reshape(q.shape).to(q.dtype)


def _cpu_kernel_ok(q: torch.Tensor) -> bool:
    """The C++ kernel takes every cache dtype under float32, bfloat16 or float16 queries."""
    return cpu_kernels.for_tensor(q) is not None


def _matmul_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, logit_softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in float32 with two matmuls: q [B, n, H, D], keys/values [B, L, Hkv, D],
    mask [B, 1, n, L] -> [B, n, H, D]. sinks [H]: one more softmax logit a head, of no value."""
    batch, n, heads, dim = q.shape
    kv_heads = keys.shape[2]
    qg = q.reshape(batch, n, kv_heads, heads // kv_heads, dim).float()  # a KV head's query group
    scores = torch.einsum("bnkgd,blkd->bkgnl", qg, keys.float()) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is not None:  # a column of each head's sink logit, dropped after the softmax
        sink = sinks.float().view(1, kv_heads, heads // kv_heads, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = torch.einsum("bkgnl,blkd->bnkgd", probs, values.float())
    return out.reshape(batch, n, heads, dim).to(q.dtype)


class _Seen(NamedTuple):
    """What a layer's query sees besides the causal mask (base.py): a window or a chunk."""
    sliding_window: int | None
    attention_chunk: int | None


def _visible(keys: torch.Tensor, q_pos: torch.Tensor, seen: _Seen, q_end: torch.Tensor | None = None) -> torch.Tensor:
    """keys [..., L] and query positions [..., 1] -> True where the query may see the key:
    causal (or, given the queries' `q_end` [..., 1], before it: base.py's key_ends), and inside
    the window or the chunk when there is one (base.py)."""
    mask = keys <= q_pos if q_end is None else keys < q_end
    if seen.sliding_window is not None:
        mask &= keys > q_pos - seen.sliding_window
    if seen.attention_chunk is not None:
        mask &= keys >= q_pos // seen.attention_chunk * seen.attention_chunk
    return mask


def _plan(meta: AttentionMetadata, block_size: int, seen: _Seen) -> list[_Group]:
    device = meta.block_tables.device
    groups = []
    decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]  # causal, key_ends or not (base.py)
    if decode:
        longest = -(-max(meta.seq_lens_cpu[i] for i in decode) // block_size) * block_size
        if len(decode) == meta.num_seqs:
            rows, tables, lens = slice(None), meta.block_tables, meta.seq_lens
        else:
            idx = torch.tensor(decode, device=device)
            rows, tables, lens = meta.query_start_loc[idx].long(), meta.block_tables[idx], meta.seq_lens[idx]
        valid = _visible(torch.arange(longest, device=device)[None, :], lens[:, None] - 1, seen)  # [B, L]
        groups.append(_Group(rows, tables.contiguous(), valid[:, None, None, :]))
    starts = meta.query_start_loc.tolist()
    short = [i for i, n in enumerate(meta.query_lens_cpu) if 1 < n <= SHORT_CHUNK]
    if short:
        groups.append(_short_chunks(meta, short, starts, block_size, seen))
    for i, n in enumerate(meta.query_lens_cpu):
        if n > SHORT_CHUNK:  # causal among the n new tokens, full over the cached prefix before them
            length = meta.seq_lens_cpu[i]
            padded = -(-length // block_size) * block_size
            q_pos = torch.arange(length - n, length, device=device)
            q_end = None if meta.key_ends is None else meta.key_ends[starts[i]:starts[i] + n, None]
            mask = _visible(torch.arange(padded, device=device)[None, :], q_pos[:, None], seen, q_end)  # [n, L]
            groups.append(_Group(slice(starts[i], starts[i] + n), meta.block_tables[i:i + 1], mask[None, None]))
    return groups


def _short_chunks(meta: AttentionMetadata, seqs: list[int], starts: list[int], block_size: int,
                  seen: _Seen) -> _Group:
    """Sequences with a few new tokens each, padded to the widest: a sequence with n < width
    new tokens repeats its last query in the padding, which writes the same output row
    again with the same value.

        seq a, n=3:  rows [r, r+1, r+2, r+2]   positions [p-3, p-2, p-1, p-1]   (width 4)
    """
    device = meta.block_tables.device
    width = max(meta.query_lens_cpu[i] for i in seqs)
    rows, positions = [], []
    for i in seqs:
        n, length = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        rows += [starts[i] + min(j, n - 1) for j in range(width)]
        positions += [length - n + min(j, n - 1) for j in range(width)]
    longest = -(-max(meta.seq_lens_cpu[i] for i in seqs) // block_size) * block_size
    q_pos = torch.tensor(positions, device=device).view(len(seqs), width)
    rows = torch.tensor(rows, device=device)
    q_end = None if meta.key_ends is None else meta.key_ends[rows].view(len(seqs), width, 1)
    mask = _visible(torch.arange(longest, device=device)[None, None, :], q_pos[:, :, None], seen, q_end)
    tables = meta.block_tables[torch.tensor(seqs, device=device)]
    return _Group(rows, tables, mask[:, None])
