"""The attention-backend contract.

Every backend does two things per layer and step: write the step's new K/V into the
paged cache through `slot_mapping` (unless the caller has: `kv_written`, on CUDA the RoPE
kernel stores them), then attend each new query over its sequence's cached context
through `block_tables`.

The batch is flattened (varlen): the new tokens of all sequences stand one after the
other. For sequences a, b, c with 3, 1 and 2 new tokens:

    tokens           a0 a1 a2 | b0 | c0 c1
    query_start_loc  0          3    4     6
    seq_lens         context of each sequence after this step (cached + new)

A sequence's token at logical position p lives in cache slot
    block_tables[seq, p // block_size] * block_size + p % block_size
and `slot_mapping[i]` is that slot for new token i. New tokens attend causally to
each other and fully to the cached prefix before them.

The cache is in the model dtype, or fp8 (float8_e4m3fn, --kv-cache-dtype fp8): then it
holds K / k_scale and V / v_scale, clamped to +-448 and rounded to nearest even, and
attention reads them back times the scale. The scales are per layer and per tensor, [1]
float32 on the device (1.0 unless a checkpoint brings calibrated ones; None means 1.0).

Per-layer options change what a query sees (Mistral, Phi-3, Gemma, Llama 4):
- `sliding_window` W: a query at position p attends only to keys at positions
  p - W < k <= p (W keys, itself included; HF's convention). None: the whole context.
- `attention_chunk` C (Llama 4's chunked local attention; never beside a window): a query
  at position p attends only to keys of its own chunk, p // C * C <= k <= p.
- `logit_softcap` c: each score s = scale * q.k becomes c * tanh(s / c) before the
  softmax (Gemma 2). None: scores as they are.

Per step, `AttentionMetadata.key_ends` (Gemma 3's images) moves each query's last key: the row
at position p sees keys k < key_ends[row] in place of k <= p; a window still bounds it from
below (p - W < k), as transformers' Gemma 3 masks its sliding layers (window AND (causal OR
same image)). The runner sets it to the image's end for an image token, whose image is wholly
in the step (the scheduler never ends a chunk inside one), and to p + 1 for every other row;
None (every step without such an image): causal. A row of one new token is never an image token
that sees past itself, so decode kernels ignore it.

Multi-head latent attention (models/mla.py) passes `value_dim` r: its k_cache is its
v_cache (one plane of one latent a token) and a value is the first r dims of its key row,
so the output is [num_tokens, num_heads, r] (the weighted latents alone). None: values are
whole rows of v_cache, the output [num_tokens, num_heads, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.layers.transfer import to_device


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    # host copies, so a CPU backend plans without device syncs
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # what a backend derives once per step and reuses in every layer
    plans: dict[str, Any] = field(default_factory=dict)
    # a model with recurrent layers (Qwen3-Next's linear attention): each sequence's state slot,
    # [num_seqs] int64 on the device and on the host; None otherwise
    state_slots: torch.Tensor | None = None
    state_slots_cpu: list[int] | None = None
    # Gemma 3's images: [num_tokens] int32 on the device, each query row's end of the keys it
    # sees (exclusive; see the module's note); None: causal
    key_ends: torch.Tensor | None = None
    # the runner runs this step's forward eagerly: no CUDA graph captures or replays it, so a layer
    # may launch work whose shapes follow the step's sequences (MLA's non-absorbed prefill:
    # models/mla.py); False in every graph's capture
    eager: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def as_decode_rows(self) -> AttentionMetadata:
        """The same step with every new token a sequence of its own: one query that ends its
        context (seq_len = its position + 1) over its sequence's block-table row. The same
        attention, as every row's K/V is written before any row attends; it is how a step that
        verifies drafts runs the decode CUDA graphs (one row a token). Causal steps only: no
        key_ends, no recurrent states."""
        assert self.key_ends is None and self.state_slots is None, "decode rows hold causal attention only"
        if "decode-rows" in self.plans:  # built once a step: the target and a drafter both replay them
            return self.plans["decode-rows"]
        owner = [i for i, q in enumerate(self.query_lens_cpu) for _ in range(q)]
        lens = [s - q + 1 + j for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu) for j in range(q)]
        device = self.seq_lens.device
        rows = self.plans["decode-rows"] = AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=device),
            seq_lens=to_device(lens, device, torch.int32),
            block_tables=self.block_tables.index_select(0, to_device(owner, device)),
            query_lens_cpu=[1] * len(lens), seq_lens_cpu=lens)
        return rows


class AttentionBackend(ABC):
    """Stateless: the cache tensors of one layer are passed in with each call."""

    name: str
    # deterministic mode (layers/batch_invariant.py): a row's output may not depend on the
    # other rows of its step; a backend that is not so by construction changes kernels
    batch_invariant = False

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """The KV write alone (what `forward` does first unless `kv_written`)."""
        raise NotImplementedError(f"the {self.name} attention backend has no KV write of its own")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,  # [1] float32: an fp8 cache's scales; unused otherwise
        v_scale: torch.Tensor | None = None,
        kv_written: bool = False,  # k and v are in the cache already (CUDA's RoPE kernel wrote them)
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32: gpt-oss's softmax logit a head, no value
        attention_chunk: int | None = None,
        value_dim: int | None = None,  # MLA: the values are each row's first value_dim dims
    ) -> torch.Tensor:  # [num_tokens, num_heads, value_dim or head_dim]
        ...
