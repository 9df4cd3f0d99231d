"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the KV cache holds one latent a
token, not keys and values per head.

Per token: c = RMSNorm(kv_a(x))[:r] (r = kv_lora_rank) and k_pe = RoPE(kv_a(x)[r:]), shared
by every head; a query head h has q_nope (nope dims) and q_pe (rope dims). transformers
expands the latent per head: k_nope_h = W_UK_h c, v_h = W_UV_h c (kv_b_proj holds
[W_UK_h; W_UV_h] for each head), and

    score_h = q_nope_h . (W_UK_h c) + q_pe_h . k_pe = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe
    out_h   = sum p_h W_UV_h c = W_UV_h (sum p_h c)

so ember absorbs W_UK into the query and W_UV after the attention (DeepSeek's own inference
does): each head's query is [W_UK_h^T q_nope_h | q_pe_h] against one cached "head" [c | k_pe]
of r + rope dims, whose values are that entry's first r dims. The attention backends run it
as multi-query attention over the latent: the cache is one plane (kv_planes 1: the layer's
k_cache and v_cache are the same tensor, so a value row is its key row), and the layer asks
for the first r dims of the values alone (`value_dim`, layers/attention/base.py): the
output is the weighted c. Decode rows always take this path: on CUDA a kernel made for it
(kernels/mla_decode.py: the r latent and the rope dims apart, a block of heads over each
cache tile).

Prefill rows absorbed would be multi-query attention over r + rope dims (576 for V2-Lite/V3),
3-4x the FLOPs of the expanded form and poor tiles. So on CUDA, in a step the runner runs
eagerly (`AttentionMetadata.eager`: more tokens than the piecewise graphs take, or no graphs),
the sequences after the step's leading decode rows run non-absorbed: every row's [c | k_pe] is
written to the cache, the decode rows attend absorbed over their own sub-step, and each
prefill sequence's whole context (prefix-cache hits and earlier chunks included) is gathered
from the cache and expanded by kv_b_proj into per-head keys [W_UK_h c | k_pe] and values
W_UV_h c (padded to the key's width), laid out as a paged cache of consecutive blocks a
sequence, and attended by the backend as plain multi-head attention of nope + rope dims in one
call (causal offsets as for any chunk over a cached prefix). The sequences go in groups whose
contexts take at most `EXPANDED_CONTEXT_LIMIT` tokens, one call a group, bounding the buffer; a
step with one context longer than that stays absorbed (logged once). On the CPU
and in deterministic mode every row stays absorbed: there a decode row must get the bits the
same token gets in a prefill, which two different computations cannot give
(`expanded_prefill` forces the path on, for tests on the CPU).

The checkpoint's RoPE dims are interleaved pairs; the loader reorders their rows to ember's
rotate-half layout (loader/weights.py), which leaves every q_pe . k_pe unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ember.distributed.parallel_state import tp_rank, tp_size
from ember.distributed.sharding import split_evenly
from ember.layers.attention import AttentionBackend, AttentionMetadata
from ember.layers.attention.torch_ref import FP8, dequantize_kv
from ember.layers.attention.triton_backend import leading_decodes
from ember.layers.linear import Linear, MergedLinear, RowParallelLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import apply_rotary
from ember.layers.transfer import to_device
from ember.models.config import ModelConfig

logger = logging.getLogger(__name__)

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2/V3RMSNorm default for q_a and kv_a's norms
# context tokens (whole blocks) expanded at once, a group of a step's prefills: V2-Lite's 16 heads of
# 192-dim keys and values take 12 KiB a token in bfloat16, so ~200 MiB, reused group after group
# (one budget of 16,384 tokens in ~1,000-token prompts spans 17 sequences' blocks: it used to leave
# such a step absorbed, 45 % of its GPU time in the absorbed attention; BENCHMARKS.md, 2026-12-06)
EXPANDED_CONTEXT_LIMIT = 16384


@dataclass(frozen=True)
class _PrefillGroup:
    """Consecutive sequences of a step whose contexts are expanded together (one buffer)."""
    tokens: slice  # their query rows in the step
    prefill: AttentionMetadata  # those sequences over the expanded buffer's blocks
    slots: torch.Tensor  # [buffer rows] int64: the cache slot each row's latent is read from


@dataclass(frozen=True)
class _ExpandedPlan:
    """A step's split for the non-absorbed prefill, built once and shared by every layer."""
    decode_tokens: int  # the leading decode rows, tokens 0 .. decode_tokens-1 (absorbed)
    decode: AttentionMetadata | None  # their sub-step; None without any
    groups: list[_PrefillGroup]  # the other sequences, in groups of at most `limit` context tokens


_logged_limit = False


def expanded_plan(meta: AttentionMetadata, block_size: int, limit: int) -> _ExpandedPlan | None:
    """The sequences after the step's leading decode rows, in groups whose contexts take at most
    `limit` tokens of whole blocks, each group's contexts in consecutive blocks of a buffer;
    rows past a context repeat its last token (never attended: past its seq_len). None when one
    sequence's context alone passes `limit`."""
    global _logged_limit
    n = leading_decodes(meta.query_lens_cpu)
    lens = np.asarray(meta.seq_lens_cpu[n:], dtype=np.int64)
    blocks = -(-lens // block_size)
    if int(blocks.max()) * block_size > limit:
        if not _logged_limit:
            _logged_limit = True
            logger.info("a prefill over %d context tokens passes MLA's expanded limit of %d: its step runs absorbed",
                        int(lens.max()), limit)
        return None
    starts = np.concatenate([[0], np.cumsum(meta.query_lens_cpu)])
    groups, first, taken = [], 0, 0
    for i, b in enumerate(blocks.tolist()):
        if (taken + b) * block_size > limit:
            groups.append(_group(meta, block_size, n + first, n + i, lens[first:i], blocks[first:i], starts))
            first, taken = i, 0
        taken += b
    groups.append(_group(meta, block_size, n + first, n + len(blocks), lens[first:], blocks[first:], starts))
    decode = None
    if n:
        decode = AttentionMetadata(
            slot_mapping=meta.slot_mapping[:n], query_start_loc=meta.query_start_loc[:n + 1],
            seq_lens=meta.seq_lens[:n], block_tables=meta.block_tables[:n], query_lens_cpu=meta.query_lens_cpu[:n],
            seq_lens_cpu=meta.seq_lens_cpu[:n], eager=True)
    return _ExpandedPlan(n, decode, groups)


def _group(meta: AttentionMetadata, block_size: int, a: int, b: int, lens: np.ndarray, blocks: np.ndarray,
           starts: np.ndarray) -> _PrefillGroup:
    """Sequences a .. b-1 of the step (contexts `lens`, in `blocks` blocks each) over a buffer of
    their blocks; `starts`: each sequence's first query row in the step."""
    rows = blocks * block_size
    seq = np.repeat(np.arange(a, b), rows)
    pos = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
    pos = np.minimum(pos, np.repeat(lens - 1, rows))
    device = meta.seq_lens.device
    seq_t, pos_t = to_device(seq, device), to_device(pos, device)
    slots = meta.block_tables[seq_t, pos_t // block_size].long() * block_size + pos_t % block_size
    first = np.cumsum(blocks) - blocks
    width = np.arange(int(blocks.max()))
    tables = np.where(width[None, :] < blocks[:, None], first[:, None] + width[None, :], 0)
    t0, t1 = int(starts[a]), int(starts[b])
    prefill = AttentionMetadata(
        slot_mapping=meta.slot_mapping[t0:t1], query_start_loc=meta.query_start_loc[a:b + 1] - t0,
        seq_lens=meta.seq_lens[a:b], block_tables=to_device(tables, device, torch.int32),
        query_lens_cpu=meta.query_lens_cpu[a:b], seq_lens_cpu=meta.seq_lens_cpu[a:b], eager=True)
    return _PrefillGroup(slice(t0, t1), prefill, slots)


class LatentAttention(nn.Module):
    # the non-absorbed prefill (the module's note): None: on CUDA outside deterministic mode; True
    # forces it on (the CPU's tests), False off
    expanded_prefill: bool | None = None
    expanded_limit = EXPANDED_CONTEXT_LIMIT

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        # tensor parallelism: the query heads split among the ranks (their rows of the query and
        # kv_b projections, their columns of o_proj), the latent's projections whole on each
        self.first_head, local = split_evenly(heads, tp_rank(), tp_size(), "attention heads")
        self.nope, self.rope, self.rank, self.v_dim = cfg.qk_nope_head_dim, cfg.rotary_dim, cfg.kv_lora_rank, \
            cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = MergedLinear.column_parallel(cfg.q_lora_rank, [heads * cfg.head_dim], what="attention heads")
        else:
            self.q_proj = MergedLinear.column_parallel(h, [heads * cfg.head_dim], what="attention heads")
        self.q_lora = bool(cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        # a plain layer: its weight is read per head (absorbed), never packed or quantized
        self.kv_b_proj = nn.Linear(self.rank, local * (self.nope + self.v_dim), bias=False)
        self.kv_b_proj.weight.weight_loader = self._load_kv_b
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias=cfg.attention_bias, what="attention heads")
        # what the attention backend sees: this rank's heads, queries of the latent's dims over one KV "head"
        self.num_heads, self.num_kv_heads, self.head_dim = local, 1, self.rank + self.rope
        self.backend = backend
        self.scale = cfg.attention_scale
        self.sliding_window = None
        self.k_cache: torch.Tensor | None = None  # bound by the runner: k_cache is v_cache
        self.v_cache: torch.Tensor | None = None
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(self, rope: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the normed hidden states [T, hidden] -> [T, hidden]."""
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe, _ = apply_rotary(q_pe.contiguous(), k_pe.contiguous().view(tokens, 1, self.rope), rope)
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank).split(
            [self.nope, self.v_dim], dim=1)
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + rope]
        plan = self._expanded_plan(meta, x)
        if plan is None:
            o_latent = self._absorbed(q_nope, q_pe, key, w_uk, meta, kv_written=False)  # [T, H, r]
            out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        else:
            out = self._expanded(q_nope, q_pe, key, w_uk, w_uv, plan, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, key: torch.Tensor, w_uk: torch.Tensor,
                  meta: AttentionMetadata, kv_written: bool) -> torch.Tensor:
        """The weighted latents [T, H, r] of queries through W_UK over the cache's [c | k_pe]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        query = torch.cat([q_latent, q_pe], dim=-1)
        return self.backend.forward(query, key, key, self.k_cache, self.v_cache, meta, self.scale, self.k_scale,
                                    self.v_scale, kv_written=kv_written, value_dim=self.rank)

    def _expanded_plan(self, meta: AttentionMetadata, x: torch.Tensor) -> _ExpandedPlan | None:
        on = self.expanded_prefill
        if on is None:
            on = x.is_cuda and not self.backend.batch_invariant
        if not on or not meta.eager or max(meta.query_lens_cpu) == 1 or self.v_dim > self.nope + self.rope:
            return None
        if "mla-expanded" not in meta.plans:  # None too: the step stays absorbed in every layer
            meta.plans["mla-expanded"] = expanded_plan(meta, self.k_cache.shape[1], self.expanded_limit)
        return meta.plans["mla-expanded"]

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, key: torch.Tensor, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, plan: _ExpandedPlan, meta: AttentionMetadata) -> torch.Tensor:
        """[T, H, v]: the leading decode rows absorbed, the other sequences over their contexts'
        expanded keys and values (the module's note)."""
        self.backend.write_kv(key, key, self.k_cache, self.v_cache, meta, self.k_scale, self.v_scale)
        n, dtype = plan.decode_tokens, q_nope.dtype
        outs = []
        if n:
            o_latent = self._absorbed(q_nope[:n], q_pe[:n], key[:n], w_uk, plan.decode, kv_written=True)
            outs.append(torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))
        cache = self.k_cache.view(-1, self.rank + self.rope)
        for group in plan.groups:
            outs.append(self._expanded_group(q_nope[group.tokens], q_pe[group.tokens], cache, group, dtype))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _expanded_group(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, group: _PrefillGroup,
                        dtype: torch.dtype) -> torch.Tensor:
        """[group tokens, H, v]: a group's queries over its contexts' expanded keys and values."""
        heads = self.num_heads
        if cache.dtype == FP8:  # no float8 gather kernel: gather the bytes
            cached = cache.view(torch.uint8)[group.slots].view(FP8)
        else:
            cached = cache[group.slots]
        cached = dequantize_kv(cached, self.k_scale).to(dtype)
        latent, k_pe = cached.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(-1, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        width = self.nope + self.rope
        block_size = self.k_cache.shape[1]
        keys = torch.cat([k_nope, k_pe[:, None].expand(-1, heads, -1)], dim=-1).view(-1, block_size, heads, width)
        values = nn.functional.pad(v, (0, width - self.v_dim)).view(-1, block_size, heads, width)
        query = torch.cat([q_nope, q_pe], dim=-1)
        o = self.backend.forward(query, query, query, keys, values, group.prefill, self.scale, kv_written=True)
        return o[..., :self.v_dim]

    def _load_kv_b(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """kv_b_proj's rows of this rank's heads ([W_UK_h; W_UV_h] a head, in head order)."""
        per_head = self.nope + self.v_dim
        if loaded.dim() != 2 or loaded.shape[1] != self.rank or loaded.shape[0] % per_head:
            raise ValueError(f"kv_b_proj of {per_head}-row heads over {self.rank} latent dims, checkpoint "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.first_head * per_head, param.shape[0]))
