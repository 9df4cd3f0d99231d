"""ModelConfig: the one description of a model's shape that every layer reads.

Built from GGUF metadata or from an HF config.json; layers never read raw configs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")

# HF `architectures[0]` -> ember's family name
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; ember runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> ModelConfig:
        archs = config.get("architectures") or []
        family = _HF_ARCHITECTURES.get(archs[0] if archs else "", config.get("model_type"))
        if family not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs or config.get('model_type')!r}; ember runs "
                f"{', '.join(_HF_ARCHITECTURES)}"
            )
        heads = config["num_attention_heads"]
        rope = config.get("rope_scaling") or config.get("rope_parameters")
        rope_theta = config.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        return ModelConfig(
            architecture=family,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            rope_scaling=_rope_scaling(rope),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=_first(config.get("eos_token_id")),
        )

    @staticmethod
    def from_hf_dir(path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return ModelConfig.from_hf_config(json.loads(file.read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON ({e}): fix or replace the file") from None
        except KeyError as e:
            raise ValueError(f"{file} lacks the required key {e.args[0]!r}: the model's config is incomplete") from None

    @staticmethod
    def from_gguf_metadata(md: dict[str, Any], tensor_names: list[str]) -> ModelConfig:
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; ember runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
            return value

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        rope_type = md.get(f"{arch}.rope.scaling.type")
        if "rope_freqs.weight" in tensor_names:
            # llama.cpp bakes Llama 3.1's frequency scaling into a rope_freqs tensor.
            raise ValueError(
                "this GGUF carries rope_freqs (Llama 3.1 RoPE scaling), which ember does not "
                "read yet: load the model from its HF directory instead"
            )
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv", heads),
            head_dim=md.get(f"{arch}.attention.key_length") or hidden // heads,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=None if rope_type in (None, "none") else _unsupported_gguf_rope(rope_type),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        )


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _rope_scaling(rope: dict[str, Any] | None) -> RopeScaling | None:
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type")
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; ember supports 'llama3'")
    return RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def _unsupported_gguf_rope(kind: str) -> RopeScaling:
    # llama.cpp bakes llama3 scaling into a rope_freqs tensor; linear/yarn need their own code.
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
