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
output is the weighted c. Prefill and decode both take this path: the cache holds nothing
else. On CUDA the decode rows run a kernel made for it (kernels/mla_decode.py: the r latent
and the rope dims apart, a block of heads over each cache tile); the prefill rows run the
generic prefill kernel over the r + rope dims, of which the backend keeps the first r.

The checkpoint's RoPE dims are interleaved pairs; the loader reorders their rows to ember's
rotate-half layout (loader/weights.py), which leaves every q_pe . k_pe unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.parallel_state import tp_rank, tp_size
from ember.distributed.sharding import split_evenly
from ember.layers.attention import AttentionBackend, AttentionMetadata
from ember.layers.linear import Linear, MergedLinear, RowParallelLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import apply_rotary
from ember.models.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2/V3RMSNorm default for q_a and kv_a's norms


class LatentAttention(nn.Module):
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
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + rope]
        o_latent = self.backend.forward(query, key, key, self.k_cache, self.v_cache, meta, self.scale,
                                        self.k_scale, self.v_scale, value_dim=self.rank)  # [T, H, r]
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim))

    def _load_kv_b(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """kv_b_proj's rows of this rank's heads ([W_UK_h; W_UV_h] a head, in head order)."""
        per_head = self.nope + self.v_dim
        if loaded.dim() != 2 or loaded.shape[1] != self.rank or loaded.shape[0] % per_head:
            raise ValueError(f"kv_b_proj of {per_head}-row heads over {self.rank} latent dims, checkpoint "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.first_head * per_head, param.shape[0]))
