"""EAGLE-3 draft heads (speculative decoding's eagle3 method), in the checkpoint layout vLLM and
SGLang load: the published heads (`LlamaForCausalLMEagle3`, with `midlayer.*` weights) and the
`speculators` library's (`Eagle3Speculator`, `layers.0.*` under a `transformer_layer_config`).

The head is one Llama decoder layer that reads the target instead of its own embeddings alone.
At position p its input is the embedding of token p + 1 and a feature of position p:

    target rows   feature = fc(concat of the target's hidden states entering 3 of its layers) [3H' -> H]
    draft rows    feature = the head's own output at p - 1, before its final norm

    e = input_layernorm(embed(token)); r = feature; h = hidden_norm(feature)
        (norm_before_residual: r = h)
    x = attention(q, k, v of concat(e, h) [2H]) + r      one paged KV cache of its own
    x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x)) over draft_vocab_size tokens; draft id d is target id d + d2t[d]

so its logits at p guess token p + 2. runner/eagle3.py runs it beside the target."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.layers.attention import AttentionBackend, AttentionMetadata
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import Linear, QKVLinear
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding
from ember.models.config import ModelConfig
from ember.models.llama import LlamaAttention, LlamaMLP

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states a head reads when its config names none
    (vLLM's and SGLang's choice: an early, a middle and a late layer)."""
    return 2, num_layers // 2, num_layers - 3


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the head's decoder layer as a one-layer Llama (hidden_size H, the target's vocabulary)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: default_aux_layers of the target
    norm_before_residual: bool
    has_embedding: bool  # else the head embeds with the target's table

    @staticmethod
    def from_dir(path: str | Path, tensor_names: list[str]) -> Eagle3Config:
        config = json.loads((Path(path) / "config.json").read_text())
        return Eagle3Config.from_hf_config(config, tensor_names)

    @staticmethod
    def from_hf_config(config: dict[str, Any], tensor_names: list[str]) -> Eagle3Config:
        archs = config.get("architectures") or []
        if not any(a in HEAD_ARCHITECTURES for a in archs) and config.get("speculators_model_type") != "eagle3":
            raise ValueError(f"speculative_config: method 'eagle3' needs an EAGLE-3 head (architectures "
                             f"{', '.join(HEAD_ARCHITECTURES)}); this model is {', '.join(archs) or 'unnamed'}: "
                             "for a small model of the same vocabulary use method 'draft_model'")
        layer = dict(config.get("transformer_layer_config") or config)
        eagle = config.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError("speculative_config: this EAGLE-3 head reads the target's last hidden state alone "
                             "(eagle_config.use_aux_hidden_state false), which ember does not run yet")
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"speculative_config: the EAGLE-3 head has {layer['num_hidden_layers']} layers; ember "
                             "runs heads of one decoder layer (the published ones)")
        layer |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                  "tie_word_embeddings": False}
        cfg = ModelConfig.from_hf_config(layer)
        aux = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(cfg, int(config.get("draft_vocab_size") or cfg.vocab_size),
                            int(config.get("target_hidden_size") or cfg.hidden_size),
                            tuple(int(i) for i in aux) if aux else None,
                            bool(config.get("norm_before_residual", False)),
                            any(n.endswith("embed_tokens.weight") for n in tensor_names))


def head_tensor_name(name: str) -> str | None:
    """A head checkpoint's tensor name -> Eagle3Head's parameter name (None: not read)."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "t2d":  # which target ids the draft vocabulary holds: d2t says it
        return None
    if name in ("d2t", "lm_head.weight"):
        return name
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return "model." + name


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend) -> None:
        super().__init__()
        lc = cfg.layer
        self.input_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.hidden_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.self_attn = LlamaAttention(lc, backend, 0)
        # q, k and v read the embedding and the feature side by side
        self.self_attn.qkv_proj = QKVLinear(2 * lc.hidden_size, lc.head_dim, lc.num_heads, lc.num_kv_heads,
                                            lc.attention_bias)
        self.post_attention_layernorm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.mlp = LlamaMLP(lc)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, rope: torch.Tensor, embeds: torch.Tensor, feature: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.hidden_norm(feature)
        residual = h.clone() if self.norm_before_residual else feature.clone()  # the norms below add into it
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)
        a = self.self_attn(rope, self.self_attn.qkv_proj(x), meta)
        h, residual = self.post_attention_layernorm(a, residual)
        return self.mlp(self.mlp.gate_up_proj(h)), residual


class Eagle3Model(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        lc = cfg.layer
        if cfg.has_embedding:
            self.embed_tokens = VocabEmbedding(lc.vocab_size, lc.hidden_size)
        self.fc = Linear(3 * cfg.target_hidden_size, lc.hidden_size)
        self.layers = nn.ModuleList([Eagle3Layer(cfg, backend)])
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.rotary = RotaryEmbedding(lc.rotary_dim, max_positions, lc.rope_theta, lc.rope_scaling)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_positions: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg.layer
        self.head_config = cfg
        self.model = Eagle3Model(cfg, max_positions, backend)
        self.lm_head = LMHead(cfg.draft_vocab_size, cfg.layer.hidden_size)
        # draft id -> target id offsets (none: the draft vocabulary is the target's)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), persistent=False)

    def attention_layers(self) -> list[LlamaAttention]:
        return [self.model.layers[0].self_attn]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's hidden states of the chosen layers [T, 3H'] -> the head's feature [T, H]."""
        return self.model.fc(aux)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm's output, the stream before it: the next draft row's feature)."""
        x, residual = self.model.layers[0](self.model.rotary.lookup(positions), embeds, feature, meta)
        return self.model.norm(x, residual)

    def target_logits(self, normed: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab_size]: the draft vocabulary's logits at their target ids (draft id d is
        target id d + d2t[d]), -inf at the target ids it lacks."""
        logits = self.lm_head(normed)
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        return full.index_copy_(1, torch.arange(logits.shape[1], device=logits.device) + self.d2t, logits)

    def target_argmax(self, normed: torch.Tensor, vocab_size: int, ascending: bool) -> torch.Tensor:
        """target_logits(normed, vocab_size).argmax(dim=-1) (ties: the first). `ascending`
        (`ascending_d2t`): the draft vocabulary's own first maximum, mapped, is the target row's
        (where every draft logit is -inf, the target row's first id, 0), without building that row."""
        if not ascending:
            return self.target_logits(normed, vocab_size).argmax(dim=-1)
        best, at = self.lm_head(normed).max(dim=-1)
        return torch.where(best == float("-inf"), 0, at + self.d2t[at])

    def ascending_d2t(self, vocab_size: int) -> bool:
        """Whether the target ids of draft ids 0, 1, ... ascend within [0, vocab_size) (the published
        heads': their d2t comes from t2d's sorted ids), so that argmaxes map with their ties."""
        ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        return bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0 and int(ids[-1]) < vocab_size
