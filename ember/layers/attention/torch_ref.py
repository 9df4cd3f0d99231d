"""Plain-torch paged attention: runs anywhere and is the oracle for the other backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.layers.attention.base import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[num_seqs, length, kv_heads, head_dim]: each sequence's first `length` cached tokens
    (past a sequence's own length, whatever its padded blocks hold: callers mask it)."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size
    return cache.view(-1, *cache.shape[2:])[slots]


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode:
            self._decode(q, k_cache, v_cache, meta, decode, scale, out)
        starts = meta.query_start_loc.tolist()
        for i, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                seq = slice(starts[i], starts[i] + n)
                out[seq] = self._extend(q[seq], k_cache, v_cache, meta.block_tables[i: i + 1],
                                        meta.seq_lens_cpu[i], scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta, rows: list[int], scale, out) -> None:
        """One new token per sequence: all such sequences in one padded batch."""
        idx = torch.tensor(rows, device=q.device)
        token_idx = meta.query_start_loc[idx].long()
        lens = meta.seq_lens[idx]
        max_len = max(meta.seq_lens_cpu[i] for i in rows)
        keys = gather_context(k_cache, meta.block_tables[idx], max_len)
        values = gather_context(v_cache, meta.block_tables[idx], max_len)
        valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
        o = _sdpa(q[token_idx].unsqueeze(1), keys, values, valid[:, None, None, :], scale)
        out[token_idx] = o.squeeze(1)

    def _extend(self, q, k_cache, v_cache, block_table, seq_len: int, scale) -> torch.Tensor:
        """n new tokens of one sequence: causal among themselves, full over the cached prefix."""
        n = q.shape[0]
        keys = gather_context(k_cache, block_table, seq_len)
        values = gather_context(v_cache, block_table, seq_len)
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
        return _sdpa(q.unsqueeze(0), keys, values, mask[None, None], scale).squeeze(0)


def _sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """q: [B, n, H, D], k/v: [B, L, Hkv, D], mask broadcastable to [B, H, n, L] -> [B, n, H, D]."""
    group = q.shape[2] // k.shape[2]
    if group > 1:
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale,
    )
    return o.transpose(1, 2)
