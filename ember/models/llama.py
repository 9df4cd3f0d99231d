"""The decoder-only transformer in one file: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3
(q/k norm), Phi-3 (its checkpoints merge q|k|v and gate|up; the loader takes them whole),
Gemma 1, 2 and 3, the mixtures of experts Mixtral, Qwen3-MoE and Qwen2-MoE (a sparse MLP, layers/moe.py,
in the layers ModelConfig.moe_layers marks), and the LayerNorm decoders GPT-2, OPT and Phi-2
(biases everywhere, a plain MLP; learned positions for the first two, attention and MLP side
by side for Phi-2), DeepSeek-V2/V3 (multi-head latent attention, models/mla.py, and
DeepSeekMoE's grouped routing with shared experts), GLM-4.5 (Llama's attention over DeepSeek's
experts), gpt-oss (attention sinks, biased experts with a clamped SwiGLU) and Llama 4 (chunked
attention, NoPE layers, top-1 experts scaled on their input). The families differ only in options that ModelConfig names (norm kind,
activation, sandwich norms, embedding scale, soft-capping, a sliding window per layer, a
second RoPE for the sliding layers, positions); each block reads them, so no block is copied.

Math only: the loader maps checkpoint names onto these parameters, and the attention
backend owns the paged KV cache. The forward takes a flattened batch (see
layers/attention/base.py) and returns hidden states; `compute_logits` runs the LM head
only on the rows that are sampled.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.distributed.parallel_state import tp_rank, tp_size
from ember.distributed.sharding import shard_heads
from ember.layers.activation import activation
from ember.layers.attention import AttentionBackend, AttentionMetadata
from ember.layers.batch_invariant import in_row_blocks
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.fused import add_norm, gelu_linear, norm_linear, silu_linear
from ember.layers.kernel_paths import cuda_paths
from ember.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from ember.layers.moe import FusedMoE, GroupedRouting
from ember.layers.norm import LayerNorm, RMSNorm
from ember.layers.rotary import CacheWrite, RotaryEmbedding, apply_rotary, norm_and_rotate
from ember.models.config import ModelConfig
from ember.models.gated_deltanet import GatedDeltaNet
from ember.models.mla import LatentAttention

Rope = torch.Tensor  # [T, rotary_dim]: cos | sin of this step's positions
# Qwen3-VL's deepstack: (the step's rows of image tokens [n], what layer k adds there [layers, n, hidden])
Deepstack = tuple[torch.Tensor, torch.Tensor]


def _norm(cfg: ModelConfig, size: int) -> RMSNorm | LayerNorm:
    if cfg.layer_norm:
        return LayerNorm(size, cfg.rms_norm_eps)
    return RMSNorm(size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        # Qwen3-Next: q_proj's rows are each head's query then its output gate, as if twice the heads
        self.output_gate = cfg.attention_output_gate
        per_head = 2 if self.output_gate else 1
        if self.output_gate:  # a rank takes whole heads, each query with its gate: the real heads must divide
            shard_heads(cfg.num_heads, cfg.num_kv_heads, tp_rank(), tp_size())
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, per_head * cfg.num_heads, cfg.num_kv_heads,
                                  cfg.attention_bias)
        # this rank's heads (all of them on one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // per_head, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.layer_norm or cfg.o_proj_bias)
        self.sinks = None
        if cfg.attention_sinks:  # gpt-oss: this rank's heads' logits
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
            self.sinks.weight_loader = self._load_sinks
        self.has_rope = cfg.layer_has_rope(layer)
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, cfg.head_dim)
            self.k_norm = _norm(cfg, cfg.head_dim)
        elif cfg.qk_l2_norm and self.has_rope:  # Llama 4's: RMS without a weight, on its RoPE layers
            self.q_norm = self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, weightless=True)
        self.qk_norm = hasattr(self, "q_norm")
        self.backend = backend
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.layer_window(layer)
        self.attention_chunk = cfg.layer_chunk(layer)
        self.logit_softcap = cfg.attn_logit_softcap
        self.k_cache: torch.Tensor | None = None  # bound by the runner once the pool exists
        self.v_cache: torch.Tensor | None = None
        # an fp8 KV cache's per-tensor scales (read only then): 1.0, vLLM's default for a
        # checkpoint without calibrated ones; tensors, so a loader could fill them later
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def forward(self, rope: Rope | None, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """qkv: the output of qkv_proj, which the decoder layer applies (fused with the norm
        before it where it can). rope: cos | sin of the positions; in a layer without RoPE
        (learned positions, Llama 4's NoPE layers) nothing turns (the backend writes k and v),
        and rope is None or each query's temperature [T] (Llama 4)."""
        q, k, v = self.qkv_proj.split(qkv)
        gate = None
        if self.output_gate:
            q, gate = q.reshape(-1, self.num_heads, 2, self.head_dim).unbind(2)
            q = q.contiguous()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cache = CacheWrite(v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        if not self.has_rope:
            if rope is not None:  # in float32, then the queries' dtype, as transformers scales them
                q = (q * rope[:, None, None]).to(q.dtype)
            written = False
        elif self.qk_norm:
            q, k, written = norm_and_rotate(q, k, rope, self.q_norm, self.k_norm, cache)
        else:
            q, k, written = apply_rotary(q, k, rope, cache)
        o = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.k_scale, self.v_scale,
                                 kv_written=written, sliding_window=self.sliding_window,
                                 logit_softcap=self.logit_softcap, sinks=self.sinks,
                                 attention_chunk=self.attention_chunk)
        o = o.reshape(-1, self.num_heads * self.head_dim)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(o.shape))
        return self.o_proj(o)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        first = self.qkv_proj.rank_rows[0][0] // self.head_dim
        if loaded.dim() != 1 or loaded.shape[0] < first + self.num_heads:
            raise ValueError(f"parameter of {self.num_heads} heads from {first}, checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, first, self.num_heads))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedLinear.column_parallel(cfg.hidden_size, [inter] * 2, what="intermediate_size")
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, what="intermediate_size")
        self.gelu = cfg.hidden_act == "gelu_tanh"

    @property
    def in_proj(self) -> MergedLinear:
        """The projection the decoder layer applies (fused with the norm before it)."""
        return self.gate_up_proj

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: the output of gate_up_proj, which the decoder layer applies (fused with
        the norm before it where it can)."""
        if self.gelu:
            return gelu_linear(self.down_proj, gate_up)
        return silu_linear(self.down_proj, gate_up)


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))), both with a bias (GPT-2, OPT, Phi-2); fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = MergedLinear.column_parallel(cfg.hidden_size, [cfg.intermediate_size], bias=True,
                                                what="intermediate_size")
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, what="intermediate_size")
        self.act = cfg.hidden_act

    @property
    def in_proj(self) -> MergedLinear:
        return self.fc1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: the output of fc1, which the decoder layer applies."""
        return self.fc2(activation(self.act, h))


class SharedExpertMoE(FusedMoE):
    """The routed experts plus one shared expert, which every token takes: Qwen2-MoE's times
    sigmoid(shared_expert_gate(x)), DeepSeek's (its shared experts as one MLP) as it is."""

    def __init__(self, cfg: ModelConfig, grouped: GroupedRouting | None) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         cfg.norm_topk_prob, grouped, fp8=cfg.fp8_experts, int_experts=cfg.int_experts)
        self.shared_expert = LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if cfg.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(self.shared_expert.gate_up_proj(x))
        if self.shared_expert_gate is None:
            return super().forward(x) + shared
        gate = self.shared_expert_gate(x) if cuda_paths(x) else in_row_blocks(self.shared_expert_gate, x)
        return super().forward(x) + torch.sigmoid(gate) * shared


class InputScaledMoE(SharedExpertMoE):
    """Llama 4: each token's one expert (the top-1 of the router's logits) takes the token
    times sigmoid(that logit), and the shared expert the token as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(self.shared_expert.gate_up_proj(x))
        logits = self.gate(x) if cuda_paths(x) else in_row_blocks(self.gate, x)
        top, ids = logits.topk(1, dim=-1)
        scaled = x * torch.sigmoid(top.float()).to(x.dtype)  # the score in x's dtype, as transformers has it
        return self.run_experts(scaled, torch.ones_like(top, dtype=torch.float32), ids) + shared


def _sparse_mlp(cfg: ModelConfig) -> FusedMoE:
    if cfg.moe_input_scaled:
        return InputScaledMoE(cfg, None)
    grouped = None
    if cfg.moe_scoring != "softmax" or cfg.moe_groups > 1 or cfg.routed_scaling_factor != 1.0:
        grouped = GroupedRouting(cfg.moe_scoring, cfg.moe_groups, cfg.moe_topk_groups, cfg.routed_scaling_factor)
    if cfg.shared_expert_intermediate_size:
        return SharedExpertMoE(cfg, grouped)
    return FusedMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                    cfg.norm_topk_prob, grouped, biased=cfg.moe_bias, swiglu=cfg.swiglu, mxfp4=cfg.mxfp4_experts,
                    fp8=cfg.fp8_experts, int_experts=cfg.int_experts)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.latent = cfg.mla  # DeepSeek: latent attention, which projects the normed state itself
        self.linear = cfg.layer_is_linear(layer)  # Qwen3-Next: gated DeltaNet in place of attention, likewise
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = LatentAttention(cfg, backend) if self.latent else LlamaAttention(cfg, backend, layer)
        self.parallel = cfg.parallel_block
        if not self.parallel:  # Phi-2: one norm a layer
            self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.moe = cfg.layer_is_moe(layer)
        self.mlp = _sparse_mlp(cfg) if self.moe else LlamaMLP(cfg) if cfg.gated_mlp else PlainMLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm normalizes the attention's output
            self.pre_feedforward_layernorm = _norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x is the last sublayer's output, residual the stream before it; each norm adds
        them first (fused on CUDA): stream + attn(norm(stream)), then + mlp(norm(...)).
        The norms go with the projections after them (layers/fused.py). With sandwich norms
        each sublayer's output is normalized too before it joins the stream. A parallel block
        (Phi-2) adds attn(norm(stream)) + mlp(norm(stream)) at once."""
        if self.parallel:
            h, residual = add_norm(self.input_layernorm, x, residual)
            return self.self_attn(rope, self.self_attn.qkv_proj(h), meta) + self.mlp(self.mlp.in_proj(h)), residual
        if self.linear:
            h, residual = add_norm(self.input_layernorm, x, residual)
            h = self.linear_attn(h, meta)
        elif self.latent:
            h, residual = add_norm(self.input_layernorm, x, residual)
            h = self.self_attn(rope, h, meta)
        else:
            qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, x, residual)
            h = self.self_attn(rope, qkv, meta)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
            gate_up, residual = norm_linear(self.pre_feedforward_layernorm, self.mlp.gate_up_proj, h, residual)
            return self.post_feedforward_layernorm(self.mlp(gate_up)), residual
        if self.moe:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        first, residual = norm_linear(self.post_attention_layernorm, self.mlp.in_proj, h, residual)
        return self.mlp(first), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        # GPT-2, OPT: a table of absolute positions (OPT's first position_offset rows unused), no RoPE
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size) \
            if cfg.learned_positions else None
        self.position_offset = cfg.position_offset
        self.rotary = None if cfg.learned_positions else \
            RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.mrope_section,
                            cfg.mrope_interleaved)
        # Gemma 3's sliding layers turn by their own RoPE
        self.local_rotary = None if cfg.local_rope_theta is None else \
            RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.local_rope_theta, cfg.local_rope_scaling)
        # what each layer turns its q and k by: the global RoPE, the local one, or none
        self.layer_rope = ["local" if self.local_rotary is not None and cfg.layer_window(i) is not None
                           else "global" if cfg.layer_has_rope(i) else "none" for i in range(cfg.num_layers)]
        self.attn_temperature = cfg.attn_temperature
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.embed_scale
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, cfg.hidden_size)
        # speculative decoding's EAGLE-3 head reads the stream entering these layers: the forward
        # returns them after the hidden states, in layer order, concatenated [T, (1 + len) * hidden]
        self.aux_layers: tuple[int, ...] = ()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' input embeddings (Gemma's scaled), before any image embeddings replace rows."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: the scale rounded to the model dtype first, as HF does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, deepstack: Deepstack | None = None) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings where some are not the tokens' (images').
        `positions`: [T], or M-RoPE's [3, T] (t, h, w) in a step over image tokens.
        `deepstack` (Qwen3-VL): rows whose hidden states layer k's output adds to, and what."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + self.position_offset)
        turns = {"global": None if self.rotary is None else self.rotary.lookup(positions),
                 "local": None if self.local_rotary is None else self.local_rotary.lookup(positions),
                 "none": None}
        if self.attn_temperature is not None:  # Llama 4's NoPE layers: each query's temperature
            scale, floor = self.attn_temperature
            turns["none"] = torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0
        residual = None
        aux = []
        for i, (layer, rope) in enumerate(zip(self.layers, self.layer_rope)):
            if i in self.aux_layers:
                aux.append(x.clone() if residual is None else x + residual)  # the norms add into residual
            x, residual = layer(turns[rope], x, residual, meta)
            if deepstack is not None and i < deepstack[1].shape[0]:  # the stream is x + residual
                x = x.index_add(0, deepstack[0], deepstack[1][i].to(x.dtype))
        out = self.norm(x, residual)[0]
        return torch.cat([out, *aux], dim=-1) if aux else out


class LlamaForCausalLM(nn.Module):
    """The LM; or, for a *ForSequenceClassification checkpoint (ModelConfig.classifier
    "score"), the same decoder with transformers' `score` head over the last token's state in
    place of the LM head (`classify`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, backend)
        if cfg.classifier == "score":
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        else:
            self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size,
                                  tied_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                                  bias=cfg.lm_head_bias)
        self.final_logit_softcap = cfg.final_logit_softcap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, deepstack: Deepstack | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, inputs_embeds, deepstack)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype (the sampler reads them in float32 where it needs to);
        Gemma 2 caps them: c * tanh(logits / c)."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def classify(self, last: torch.Tensor) -> torch.Tensor:
        """[N, hidden] last-token states (after the final norm) -> [N, num_labels] logits."""
        return self.score(last)

    def attention_layers(self) -> list[LlamaAttention | LatentAttention]:
        """The layers whose K/V the paged cache holds, in order (not the linear-attention ones)."""
        return [layer.self_attn for layer in self.model.layers if not layer.linear]

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The layers that keep a recurrent state a sequence (runner/recurrent_state.py binds them)."""
        return [layer.linear_attn for layer in self.model.layers if layer.linear]
