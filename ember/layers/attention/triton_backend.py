"""Triton paged attention for CUDA: the KV-write kernel (unless the RoPE kernel wrote K/V),
then flash-decoding when every sequence has one new token, else the varlen prefill/extend
kernel (which also takes the decode rows of a mixed step). In deterministic mode
(`batch_invariant`) every step takes the prefill kernel: flash-decoding splits a row's keys
by the batch size, and a decode row must get the bits the same token gets in a prefill
(after preemption, or as part of another request's cached prefix). Reads only device tensors and
the host query lengths, so a decode step can be captured in a CUDA graph. An fp8 cache:
see kernels/paged.py. A layer's sliding window and soft cap go to the kernels as
arguments (constant per layer, so a graph captures them with the layer's launch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.layers.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _Plan:
    decode: bool
    max_query_len: int
    num_splits: int


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from ember.kernels import decode_attention, kv_write, prefill_attention  # triton only here

        self._kv_write = kv_write.kv_write
        self._decode = decode_attention.decode_attention
        self._num_splits = decode_attention.num_decode_splits
        self._prefill = prefill_attention.prefill_attention

    def plan(self, meta: AttentionMetadata, num_kv_heads: int) -> _Plan:
        plan = meta.plans.get(self.name)
        if plan is None:
            max_q = max(meta.query_lens_cpu)
            batch = meta.seq_lens.shape[0]  # a graph's padded batch: the split count is fixed by it
            plan = meta.plans[self.name] = _Plan(max_q == 1 and not self.batch_invariant, max_q,
                                                 self._num_splits(batch, num_kv_heads))
        return plan

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                kv_written: bool = False, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        if not kv_written:
            self._kv_write(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        plan = self.plan(meta, k_cache.shape[2])  # one plan for all layers, windowed or not
        options = dict(k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, logit_softcap=logit_softcap)
        if plan.decode:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, plan.num_splits,
                                **options)
        return self._prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             plan.max_query_len, scale, pack_gqa=self.batch_invariant, **options)
