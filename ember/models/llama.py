"""The Llama family in one file: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Math only: the loader maps checkpoint names onto these parameters, and the attention
backend owns the paged KV cache. The forward takes a flattened batch (see
layers/attention/base.py) and returns hidden states; `compute_logits` runs the LM head
only on the rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.layers.attention import AttentionBackend, AttentionMetadata
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.fused import norm_linear, silu_linear
from ember.layers.linear import Linear, MergedLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import CacheWrite, RotaryEmbedding, apply_rotary, norm_and_rotate
from ember.models.config import ModelConfig


Rope = torch.Tensor  # [T, head_dim]: cos | sin of this step's positions


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        self.scale = cfg.head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None  # bound by the runner once the pool exists
        self.v_cache: torch.Tensor | None = None
        # an fp8 KV cache's per-tensor scales (read only then): 1.0, vLLM's default for a
        # checkpoint without calibrated ones; tensors, so a loader could fill them later
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(self, rope: Rope, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv: the output of qkv_proj, which the decoder layer applies (fused with the norm
        before it where it can)."""
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cache = CacheWrite(v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if self.qk_norm:
            q, k, written = norm_and_rotate(q, k, rope, self.q_norm, self.k_norm, cache)
        else:
            q, k, written = apply_rotary(q, k, rope, cache)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                 kv_written=written)
        return self.o_proj(o.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: the output of gate_up_proj, which the decoder layer applies (fused with
        the norm before it where it can)."""
        return silu_linear(self.down_proj, gate_up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, residual the stream before it; each norm adds
        them first (fused on CUDA): stream + attn(norm(stream)), then + mlp(norm(...)).
        The norms go with the projections after them (layers/fused.py)."""
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
        h = self.self_attn(rope, qkv, meta)
        gate_up, residual = norm_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, h, residual)
        return self.mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, backend)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                              tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler reads them in float32 where it needs to)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]
