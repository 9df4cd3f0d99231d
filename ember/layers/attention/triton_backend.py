"""Triton paged attention for CUDA: the KV-write kernel (unless the RoPE kernel wrote K/V),
then flash-decoding when every sequence has one new token, else the varlen prefill/extend
kernel. A mixed step whose first sequences decode (the scheduler puts running requests
first) sends those rows to flash-decoding too and only the rest to the prefill kernel:
there a decode row would fill one row of a 64-row tile and read its context once per query
head, not once per KV head. In deterministic mode
(`batch_invariant`) every step takes the prefill kernel: flash-decoding splits a row's keys
by the batch size, and a decode row must get the bits the same token gets in a prefill
(after preemption, or as part of another request's cached prefix). Reads only device tensors and
the host query lengths, so a decode step can be captured in a CUDA graph. An fp8 cache:
see kernels/paged.py. A layer's sliding window (or attention chunk) and soft cap go to the kernels as
arguments (constant per layer, so a graph captures them with the layer's launch). A step's
key_ends (Gemma 3's images) go to the prefill kernel; decode rows never need them (base.py).

Multi-head latent attention (`value_dim`: base.py) sends its decode rows, a decode step's
or a mixed step's leading ones, to its own kernel (kernels/mla_decode.py: the latent and
rope dims apart, a block of heads over each tile); its other rows take the prefill kernel
as multi-query attention, whose output's latent dims are kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.layers.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _Plan:
    decode: bool
    max_query_len: int
    num_splits: int
    decode_rows: int = 0  # a mixed step: its leading sequences of one new token each, for flash-decoding
    decode_splits: int = 1


def leading_decodes(query_lens: list[int]) -> int:
    """How many of the step's first sequences have one new token."""
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from ember.kernels import decode_attention, kv_write, mla_decode, prefill_attention  # triton only here

        self._kv_write = kv_write.kv_write
        self._decode = decode_attention.decode_attention
        self._num_splits = decode_attention.num_decode_splits
        self._prefill = prefill_attention.prefill_attention
        self._mla_decode = mla_decode.mla_decode
        self._mla_head_blocks = mla_decode.mla_head_blocks

    def plan(self, meta: AttentionMetadata, parallel: int) -> _Plan:
        """`parallel`: the decode programs a sequence's split takes, its KV heads (MLA: its
        head blocks); a model's layers are all of one kind, so the first layer's plan serves all."""
        plan = meta.plans.get(self.name)
        if plan is None:
            max_q = max(meta.query_lens_cpu)
            batch = meta.seq_lens.shape[0]  # a graph's padded batch: the split count is fixed by it
            rows = 0 if max_q == 1 or self.batch_invariant else leading_decodes(meta.query_lens_cpu)
            plan = meta.plans[self.name] = _Plan(max_q == 1 and not self.batch_invariant, max_q,
                                                 self._num_splits(batch, parallel), rows,
                                                 self._num_splits(rows, parallel) if rows else 1)
        return plan

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        self._kv_write(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_written: bool = False, sliding_window: int | None = None,
                logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                attention_chunk: int | None = None, value_dim: int | None = None) -> torch.Tensor:
        if not kv_written:
            self.write_kv(k, v, k_cache, v_cache, meta, k_scale, v_scale)
        if value_dim is not None:
            return self._latent(q, k_cache, v_cache, meta, scale, k_scale, v_scale, sliding_window, logit_softcap,
                                sinks, value_dim)
        plan = self.plan(meta, k_cache.shape[2])  # one plan for all layers, windowed or not
        options = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap,
                       sinks=sinks, attention_chunk=attention_chunk)
        if plan.decode:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, plan.num_splits,
                                **options)
        if not plan.decode_rows:
            return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                 plan.max_query_len, scale, pack_gqa=self.batch_invariant, key_ends=meta.key_ends,
                                 **options)
        n = plan.decode_rows  # they are tokens 0 .. n-1
        out = torch.empty_like(q)
        self._decode(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale, plan.decode_splits,
                     out=out[:n], **options)
        return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             plan.max_query_len, scale, out=out, first_seq=n, key_ends=meta.key_ends, **options)

    def _latent(self, q, cache, v_cache, meta: AttentionMetadata, scale: float, k_scale, v_scale,
                sliding_window: int | None, logit_softcap: float | None, sinks: torch.Tensor | None,
                value_dim: int) -> torch.Tensor:
        """Multi-head latent attention: [T, H, value_dim], decode rows through mla_decode."""
        if cache.data_ptr() != v_cache.data_ptr() or cache.shape[2] != 1:
            raise ValueError("value_dim (multi-head latent attention) needs one cache plane of one KV head: "
                             "k_cache must be v_cache")
        if sliding_window is not None or logit_softcap is not None or sinks is not None:
            raise ValueError("multi-head latent attention takes no sliding window, soft cap or sinks")
        plan = self.plan(meta, self._mla_head_blocks(q.shape[1]))
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        if plan.decode:
            return self._mla_decode(q, cache, meta.block_tables, meta.seq_lens, scale, value_dim, plan.num_splits,
                                    **scales)
        out = torch.empty_like(q)
        n = plan.decode_rows  # tokens 0 .. n-1; 0 in deterministic mode (every row to the prefill kernel)
        if n:
            self._mla_decode(q[:n], cache, meta.block_tables[:n], meta.seq_lens[:n], scale, value_dim,
                             plan.decode_splits, out=out[:n, :, :value_dim], **scales)
        self._prefill(q, cache, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, plan.max_query_len,
                      scale, out=out, first_seq=n, pack_gqa=self.batch_invariant, **scales)
        return out[..., :value_dim]
