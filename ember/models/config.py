"""ModelConfig: the one description of a model's shape that every layer reads.

Built from GGUF metadata or from an HF config.json; layers never read raw configs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ember.layers.rope_scaling import RopeScaling
from ember.models.families import (
    BY_GGUF_ARCHITECTURE,
    BY_GGUF_EXPERTS,
    BY_HF_ARCHITECTURE,
    BY_HF_MODEL_TYPE,
    FAMILIES,
    FLAT_TEXT_CONFIG_ARCHITECTURES,
    TEXT_CONFIG_FAMILY_ARCHITECTURES,
    VISION_LANGUAGE_ARCHITECTURES,
    VISION_LANGUAGE_MODEL_TYPES,
    Family,
)
from ember.models.vision_config import VisionConfig, vision_config

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
GGUF_ARCHITECTURES = tuple(BY_GGUF_ARCHITECTURE)
# the sizes no default stands in for (Gemma3TextConfig's are Gemma 2 2B's, no Gemma 3's)
_TEXT_CONFIG_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers")

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")




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
    rms_norm_eps: float  # the norms' eps (LayerNorm's in an encoder)
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head of q and k
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"  # silu | gelu_tanh: the MLP's act(gate) * up
    # Gemma: a checkpoint's norm weight w is applied as (1 + w) (the loader folds the 1 in)
    norm_unit_offset: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: a norm on each sublayer's output too
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale is its -1/2 power, not head_dim's
    attn_logit_softcap: float | None = None  # Gemma 2: scores c * tanh(s / c)
    final_logit_softcap: float | None = None  # Gemma 2: logits likewise
    # the sliding window of each layer (None: attends the whole context); None: no layer has one
    layer_windows: tuple[int | None, ...] | None = None
    # Gemma 3: the sliding layers' own RoPE (base, scaling); None: every layer shares one
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling | None = None
    # RoPE turns each head's first rotary_dim dims (HF's rotate-half pairs within them), the
    # rest pass through (Phi-4-mini: 96 of 128); None: the whole head
    rotary_dim: int | None = None
    # a vision-language checkpoint (Gemma3ForConditionalGeneration, LlavaForConditionalGeneration):
    # its language model is this config; `vision` is its image side where ember runs it (then
    # the runner loads the tower and projector: models/llava.py), None where ember serves the
    # language model on text prompts alone (the loader skips the vision tensors)
    multimodal: bool = False
    vision: VisionConfig | None = None
    # M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a position is (t, h, w), and of each head's rotary_dim / 2
    # frequencies the first sections[0] turn by t, the next sections[1] by h, the last by w; a
    # text token's three are equal (plain RoPE). None: positions are one number
    mrope_section: tuple[int, int, int] | None = None
    # Qwen3-VL's interleaved M-RoPE: frequency i turns by h where i % 3 == 1 and i < 3 * sections[1],
    # by w where i % 3 == 2 and i < 3 * sections[2], by t elsewhere
    mrope_interleaved: bool = False
    # mixture of experts (Mixtral, Qwen3-MoE): which layers' MLP is sparse (None: none is), the
    # number of experts, how many each token goes to, each expert's intermediate size, and
    # whether the top-k routing weights are renormalized to sum to 1
    moe_layers: tuple[bool, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen2-MoE: a shared expert of this intermediate size beside the routed ones, its output
    # times sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_intermediate_size: int = 0
    # an encoder (models/bert.py): attention sees the whole prompt both ways, so nothing is
    # cached; learned positions from position_offset (RoBERTa: pad_token_id + 1); segment
    # embeddings for type_vocab_size token types
    bidirectional: bool = False
    type_vocab_size: int = 0
    position_offset: int = 0
    # a sequence-classification head ("bert": pooler then classifier; "roberta": dense, tanh,
    # out_proj) over the first token, with one name per label (id2label); None: none
    classifier: str | None = None
    label_names: tuple[str, ...] = ()
    # the LayerNorm decoders (GPT-2, OPT, Phi-2): LayerNorm (weight and bias) in place of RMSNorm,
    # a bias on every projection, an MLP of fc2(act(fc1(x))) rather than a gated one; GPT-2 and
    # OPT add a learned table of absolute positions (position_offset) and turn no RoPE; Phi-2's
    # attention and MLP read one norm's output side by side, and its LM head has a bias
    layer_norm: bool = False
    gated_mlp: bool = True
    learned_positions: bool = False
    parallel_block: bool = False
    lm_head_bias: bool = False
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; models/mla.py) where kv_lora_rank > 0:
    # the KV cache holds each token's latent (kv_lora_rank) and its RoPE key (rotary_dim), one
    # "head" for all; head_dim is a query head's nope + rope dims (qk_nope_head_dim + rotary_dim),
    # v_head_dim a value head's; q_lora_rank 0: queries projected from the hidden state directly
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # the attention scale times this (DeepSeek's YaRN: mscale(factor, mscale_all_dim) squared)
    attention_scale_factor: float = 1.0
    # DeepSeekMoE's router: "softmax" (V2) or "sigmoid" with a per-expert bias on the choice only
    # (V3); experts picked within the topk_group best of n_group groups (a group's score: its
    # best expert's, or with the bias its best two's sum); weights times routed_scaling_factor
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (DeepSeek: none)
    # the checkpoint's RoPE dims are interleaved pairs (DeepSeek): the loader reorders their rows
    # to ember's rotate-half layout
    rope_interleaved: bool = False
    # gpt-oss: a learned softmax logit a head (attention sinks), a bias on o_proj too, a router
    # and experts with biases, and the experts' clamped SwiGLU: (clamp(up, -l, l) + 1) *
    # g * sigmoid(alpha * g), g = min(gate, l), for (alpha, l) = swiglu; None: silu(gate) * up
    attention_sinks: bool = False
    o_proj_bias: bool = False
    moe_bias: bool = False
    swiglu: tuple[float, float] | None = None
    # Llama 4: the layers with RoPE attend within chunks (`layer_chunks`, each layer's chunk or
    # None: layers/attention/base.py) and L2-norm q and k (a weightless RMSNorm); the others
    # (`nope_layers`) have no RoPE, attend globally, and with `attn_temperature` (attn_scale,
    # floor_scale) scale their queries by 1 + attn_scale * log1p(floor((p + 1) / floor_scale));
    # the router's sigmoid score scales its one expert's input, not its output
    layer_chunks: tuple[int | None, ...] | None = None
    nope_layers: tuple[bool, ...] | None = None
    attn_temperature: tuple[float, float] | None = None
    qk_l2_norm: bool = False
    moe_input_scaled: bool = False
    # the checkpoint's experts are MXFP4 blocks and scales (config.json's quantization_config
    # quant_method mxfp4: gpt-oss's releases); load_model keeps them so on CUDA (the fused MoE
    # kernels decode them) and clears it elsewhere, where the loader decodes them to dense
    mxfp4_experts: bool = False
    # an FP8 checkpoint's experts kept FP8, their scales per "row" or per 128 x 128 "block"
    # (layers/moe.py): set by load_model on CUDA (loader/fp8_checkpoint.fp8_experts); None (the
    # config's own): the experts are dense, an FP8 checkpoint's dequantized at load
    fp8_experts: Literal["block", "row"] | None = None
    # an AWQ / GPTQ / compressed-tensors checkpoint's experts kept packed, as (bits, group_size,
    # symmetric) (layers/moe.py): set by load_model where the fused MoE kernels run
    # (loader/int_checkpoint.int_experts); None: the experts are dense, dequantized at load
    int_experts: tuple[int, int, bool] | None = None
    # Qwen3-Next: q_proj gives each head's query and an output gate (the attention's output times
    # sigmoid(gate)); which layers are gated DeltaNet linear attention (models/gated_deltanet.py;
    # None: none), with their key (and query) heads, value heads, the heads' dims and the causal
    # convolution's kernel
    attention_output_gate: bool = False
    linear_layers: tuple[bool, ...] | None = None
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def cache_kv_heads(self) -> int:
        """Heads of each token's entry in the KV cache: one latent for MLA."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.rotary_dim if self.mla else self.head_dim

    @property
    def kv_planes(self) -> int:
        """K and V (2), or MLA's one latent (1): its values are the keys' first kv_lora_rank dims."""
        return 1 if self.mla else 2

    def __post_init__(self) -> None:
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name, ())
                if factors and len(factors) != self.rotary_dim // 2:
                    raise ValueError(
                        f"LongRoPE's {name} has {len(factors)} entries; a RoPE over {self.rotary_dim} dims of each "
                        f"head needs {self.rotary_dim // 2} (one per frequency): the config's rope_scaling does not "
                        "fit its head_dim / partial_rotary_factor")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.rotary_dim:
            raise ValueError(f"mrope_section {list(self.mrope_section)} covers {sum(self.mrope_section)} frequencies; "
                             f"a RoPE over {self.rotary_dim} dims has {self.rotary_dim // 2}: the config's "
                             "rope_parameters do not fit its head_dim")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; ember runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        acts = ("gelu", "gelu_tanh") if self.bidirectional else ("silu", "gelu_tanh") if self.gated_mlp else \
            ("gelu", "gelu_tanh", "relu")
        if self.hidden_act not in acts:
            raise ValueError(f"unsupported MLP activation {self.hidden_act!r}; ember runs {' and '.join(acts)} here")
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        for name in ("layer_chunks", "nope_layers"):
            if getattr(self, name) is not None and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{len(getattr(self, name))} {name} for {self.num_layers} layers")
        if self.moe_input_scaled and self.num_experts_per_tok != 1:
            raise ValueError(f"Llama 4 with num_experts_per_tok {self.num_experts_per_tok} is not supported: ember "
                             "routes its experts top-1, as the released models do")
        if self.linear_layers is not None:
            if len(self.linear_layers) != self.num_layers:
                raise ValueError(f"{len(self.linear_layers)} layer types for {self.num_layers} layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.moe_layers is not None and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be within 1..num_experts "
                             f"({self.num_experts})")

    def layer_is_linear(self, layer: int) -> bool:
        return self.linear_layers is not None and self.linear_layers[layer]

    @property
    def num_attention_layers(self) -> int:
        """Layers of softmax attention, whose K/V the paged cache holds (linear layers keep a state)."""
        return self.num_layers - sum(self.linear_layers or ())

    @property
    def linear_conv_dim(self) -> int:
        """The channels of a linear layer's convolution: its q | k | v."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim

    def layer_is_moe(self, layer: int) -> bool:
        return self.moe_layers is not None and self.moe_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        return None if self.layer_windows is None else self.layer_windows[layer]

    def layer_chunk(self, layer: int) -> int | None:
        return None if self.layer_chunks is None else self.layer_chunks[layer]

    def layer_has_rope(self, layer: int) -> bool:
        return not self.learned_positions and (self.nope_layers is None or not self.nope_layers[layer])

    @property
    def max_context(self) -> int:
        """The longest context the model serves: its own, or for YaRN and dynamic NTK the
        trained one stretched by the factor (asked for with max_model_len; the default stays
        max_position_embeddings)."""
        s = self.rope_scaling
        if s is not None and s.kind in ("yarn", "dynamic"):
            return max(self.max_position_embeddings, int(s.original_max_position_embeddings * s.factor))
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5 * self.attention_scale_factor

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> ModelConfig:
        fam, multimodal = _family(config)
        if fam.encoder:
            return _encoder_config(config, fam)
        vision = None
        if multimodal:
            outer, config = config, _language_model_config(config)
            vision = vision_config(outer, config["hidden_size"])
        if fam.layer_norm:
            config = _layer_norm_decoder_config(config, fam)
        config = fam.hf_config_defaults | config
        if fam.hf_config_keys and not fam.layer_norm:  # Llama 4's sizes under ember's keys
            config = {fam.hf_config_keys.get(k, k): v for k, v in config.items()}
        family, gemma = fam.name, fam.gemma
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        global_rope, local_rope = _rope_parameters(config)
        rope_theta = float(config.get("rope_theta") or global_rope.get("rope_theta")
                           or fam.rope_theta)
        # transformers 5 keeps the factor among the RoPE parameters, earlier ones beside them
        rotary_factor = float(config.get("partial_rotary_factor") or global_rope.get("partial_rotary_factor")
                              or fam.partial_rotary_factor)
        rotary_dim = int(head_dim * rotary_factor)
        mla = _mla_options(config, global_rope) if fam.mla else {}
        if mla:  # a query head: nope + rope dims; RoPE on the last qk_rope_head_dim
            head_dim, rotary_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["qk_rope_head_dim"]
        act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
        if gemma and act == "gelu":  # Gemma 1's config.json: meant as the tanh GELU (transformers, vLLM)
            act = "gelu_tanh"
        if gemma and config.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not a causal LM")
        num_layers = config["num_hidden_layers"]
        local_theta = None
        if fam.local_rope_theta is not None:
            local_theta = float(config.get("rope_local_base_freq") or (local_rope or {}).get("rope_theta")
                                or fam.local_rope_theta)
        return ModelConfig(
            architecture=family,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=heads if mla else config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma or fam.tied_default)),
            attention_bias=_qkv_bias(config, fam),
            qk_norm=fam.qk_norm or bool(fam.qk_norm_key and config.get(fam.qk_norm_key)),
            rope_scaling=_rope_scaling(global_rope, config),
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=_first(config.get("eos_token_id")),
            hidden_act=_ACTIVATIONS.get(act, act),
            norm_unit_offset=gemma or fam.unit_offset_norms,
            sandwich_norms=fam.sandwich_norms,
            embed_scale=config["hidden_size"] ** 0.5 if gemma else None,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcap=config.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=config.get("final_logit_softcapping") if gemma else None,
            layer_windows=_layer_windows(config, fam, num_layers),
            **(_chunked_nope_options(config, num_layers) if fam.chunked_nope else {}),
            local_rope_theta=local_theta,
            local_rope_scaling=_rope_scaling(local_rope, config) if local_rope else None,
            rotary_dim=rotary_dim,
            multimodal=multimodal,
            vision=vision,
            **_mrope(global_rope, vision),
            **_moe_options(config, fam, num_layers),
            **_score_head(config),
            **_layer_norm_options(fam),
            **mla,
            attention_sinks=fam.attention_sinks,
            o_proj_bias=bool(fam.o_proj_bias_key and config.get(fam.o_proj_bias_key)),
            attention_output_gate=fam.attention_output_gate,
            **(_linear_attention_options(config, num_layers) if fam.linear_attention else {}),
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
    def from_gguf_metadata(md: dict[str, Any], tensor_names: list[str],
                           read_vector: Callable[[str], list[float]] | None = None) -> ModelConfig:
        """From llama.cpp's metadata keys. `read_vector` reads a small tensor of the file: the
        RoPE factors llama.cpp stores as tensors (rope_freqs, rope_factors_long/short)."""
        arch = md.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; ember runs {', '.join(GGUF_ARCHITECTURES)}"
            )
        fam = BY_GGUF_ARCHITECTURE[arch]
        if md.get(f"{arch}.attention.temperature_scale") is not None:
            raise ValueError(f"a {arch} GGUF with {arch}.attention.temperature_scale (Ministral 3's llama_4_scaling_beta) "
                             "is not supported: ember does not scale queries by their position")

        def get(key: str, default: Any = None) -> Any:
            value = md.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
            return value

        def vector(name: str) -> tuple[float, ...]:
            if read_vector is None:
                raise ValueError(f"reading this GGUF's config needs its tensor {name}")
            return tuple(float(x) for x in read_vector(name))

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        head_dim = md.get(f"{arch}.attention.key_length") or hidden // heads
        # GLM-4.5's converter counts its multi-token-prediction layers among the blocks (the loader skips them)
        layers = get("block_count") - md.get(f"{arch}.nextn_predict_layers", 0)
        vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
        context = get("context_length")
        gemma = fam.gemma
        rotary_dim = md.get(f"{arch}.rope.dimension_count") or head_dim
        if fam.gguf_rope_permuted and rotary_dim != head_dim:
            # llama.cpp's converter permutes whole heads for its adjacent-pair RoPE; the loader
            # undoes that for whole-head RoPE only
            raise ValueError(f"a llama GGUF with RoPE on {rotary_dim} of each head's {head_dim} dims "
                             "(rope.dimension_count) is not supported: serve the model's HF checkpoint "
                             "directory instead")
        ff = get("feed_forward_length")
        rope_scaling = _gguf_rope_scaling(md, arch, tensor_names, vector)
        mla: dict[str, Any] = {}
        if fam.moe == "deepseek":
            moe = _gguf_deepseek_moe_options(md, arch, layers)
        elif fam.moe == "gpt_oss":
            moe = _gguf_gpt_oss_options(md, arch, layers)
        elif fam.moe == "llama4":
            moe = _gguf_llama4_options(md, arch, layers)
        if fam.mla:
            mla, rope_scaling = _gguf_mla_options(md, arch, rope_scaling)
            head_dim, rotary_dim = mla.pop("head_dim"), get("rope.dimension_count")
        if fam.moe not in ("deepseek", "gpt_oss", "llama4"):
            moe = _gguf_moe_options(md, arch, layers, ff)
        query_scalar = None
        if fam.gguf_hidden_query_scale_layers:  # llama.cpp's Gemma 2/3 rule: the 27B models (by layer count)
            # scale by hidden / heads, others by head_dim; Gemma 1 by head_dim as any model
            query_scalar = hidden // heads if layers == fam.gguf_hidden_query_scale_layers else head_dim
        # the sliding layers' own RoPE base, as llama.cpp reads it: Gemma 3's defaults to 10000,
        # Gemma 2's to the global one (and keeps the global scaling)
        local_theta = md.get(f"{arch}.rope.freq_base_swa") if gemma else None
        if local_theta is None:
            local_theta = fam.local_rope_theta
        # soft-caps: Gemma 2's default to llama.cpp's 50 and 30 where the keys lack; Gemma 3 caps
        # only where a key says so (0: none)
        attn_cap, final_cap = fam.gguf_softcaps
        final_cap = md.get(f"{arch}.final_logit_softcapping", final_cap) if gemma else None
        return ModelConfig(
            architecture=moe.pop("family", fam.name),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ff,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads if mla else get("attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=float(get(f"attention.layer_norm{'' if fam.layer_norm else '_rms'}_epsilon")),
            rope_theta=float(get("rope.freq_base", fam.rope_theta)),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=(fam.qkv_bias_key is None and fam.qkv_bias_default) or "blk.0.attn_q.bias" in tensor_names,
            qk_norm=any(n.endswith(".attn_q_norm.weight") for n in tensor_names),  # (Qwen3-Next: not in block 0)
            rope_scaling=rope_scaling,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
            hidden_act="gelu_tanh" if gemma or fam.layer_norm else "silu",  # llama.cpp: GPT-2's and Phi-2's GELU is tanh's
            norm_unit_offset=gemma or fam.unit_offset_norms,
            sandwich_norms=fam.sandwich_norms,
            embed_scale=hidden ** 0.5 if gemma else None,
            query_pre_attn_scalar=query_scalar,
            attn_logit_softcap=md.get(f"{arch}.attn_logit_softcapping", attn_cap) if attn_cap is not None else None,
            final_logit_softcap=final_cap or None,
            layer_windows=None if fam.chunked_nope else _gguf_layer_windows(md, arch, layers),
            local_rope_theta=None if local_theta is None else float(local_theta),
            # Gemma 2's sliding layers keep the global scaling, Gemma 3's have their own base
            local_rope_scaling=rope_scaling if gemma and fam.local_rope_theta is None and local_theta is not None
            else None,
            rotary_dim=rotary_dim,
            **moe,
            **_layer_norm_options(fam),
            **mla,
            attention_sinks=fam.attention_sinks,
            # gpt-oss's; the LayerNorm decoders' biases come with layer_norm
            o_proj_bias=not fam.layer_norm and "blk.0.attn_output.bias" in tensor_names,
            attention_output_gate=fam.attention_output_gate,
            **(_gguf_linear_attention_options(md, arch, layers) if fam.linear_attention else {}),
            **(_gguf_mrope(md, arch, fam.gguf_mrope[1]) if fam.gguf_mrope and arch == fam.gguf_mrope[0] else {}),
        )


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list) else value


def _family(config: dict[str, Any]) -> tuple[Family, bool]:
    """(ember's family, whether the checkpoint is a vision-language one) of a config.json,
    by its `architectures`, or failing that its `model_type`."""
    archs = config.get("architectures") or []
    if archs:
        family = BY_HF_ARCHITECTURE.get(archs[0])
        if archs[0] in TEXT_CONFIG_FAMILY_ARCHITECTURES:  # LLaVA: its language model's family
            text_type = (config.get("text_config") or {}).get("model_type", "llama")
            family = BY_HF_MODEL_TYPE.get(text_type)
            if family is None:
                raise ValueError(f"{archs[0]} with a {text_type!r} language model (text_config.model_type) is not "
                                 f"supported; ember runs {', '.join(BY_HF_MODEL_TYPE)}")
            return family, True
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs[0]!r} (model_type {config.get('model_type')!r}); ember runs "
                f"{', '.join(BY_HF_ARCHITECTURE)}. A model is run only under an architecture ember knows: "
                "running it as another could give wrong tokens"
            )
        return family, archs[0] in VISION_LANGUAGE_ARCHITECTURES
    model_type = config.get("model_type", "")
    family = BY_HF_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported model_type {config.get('model_type')!r} and no `architectures` in config.json; "
            f"ember runs {', '.join(BY_HF_ARCHITECTURE)}"
        )
    return family, model_type in VISION_LANGUAGE_MODEL_TYPES


def _encoder_config(config: dict[str, Any], fam: Family) -> ModelConfig:
    """BERT and XLM-RoBERTa (BertConfig's and XLMRobertaConfig's keys); a
    *ForSequenceClassification checkpoint adds its head and labels (id2label, else
    num_labels, else transformers' default of two)."""
    arch = (config.get("architectures") or [""])[0]
    heads = config["num_attention_heads"]
    act = config.get("hidden_act", "gelu")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{arch or fam.name}: position_embedding_type {config['position_embedding_type']!r} is not "
                         "supported; ember runs absolute positions")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        raise ValueError(f"{arch or fam.name} configured as a decoder (is_decoder / add_cross_attention): ember runs "
                         "BERT-style models as encoders only")
    classifier, labels = None, ()
    if arch.endswith("ForSequenceClassification"):
        classifier = "roberta" if fam.position_offset_from_pad else "bert"
        labels = _label_names(config)
    pad = config.get("pad_token_id")
    offset = (pad if pad is not None else 1) + 1 if fam.position_offset_from_pad else 0
    positions = config.get("max_position_embeddings", 512)
    return ModelConfig(
        architecture=fam.name,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=config["hidden_size"] // heads,
        rms_norm_eps=config.get("layer_norm_eps", 1e-12),
        rope_theta=0.0,
        max_position_embeddings=positions - offset,  # RoBERTa's first offset rows are never a position
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_first(config.get("eos_token_id")),
        hidden_act={"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act),
        bidirectional=True,
        type_vocab_size=config.get("type_vocab_size", 2),
        position_offset=offset,
        classifier=classifier,
        label_names=labels,
    )


def _score_head(config: dict[str, Any]) -> dict[str, Any]:
    """A decoder *ForSequenceClassification checkpoint's head: transformers' `score` over the
    last token, in place of the LM head."""
    arch = (config.get("architectures") or [""])[0]
    if not arch.endswith("ForSequenceClassification"):
        return {}
    return {"classifier": "score", "label_names": _label_names(config)}


def _label_names(config: dict[str, Any]) -> tuple[str, ...]:
    """A classification checkpoint's label names: id2label, else num_labels of LABEL_i, else
    transformers' default of two."""
    id2label = config.get("id2label") or {}
    count = len(id2label) or int(config.get("num_labels", 2))
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _qkv_bias(config: dict[str, Any], fam: Family) -> bool:
    if fam.qkv_bias_key is None:
        return fam.qkv_bias_default
    return bool(config.get("attention_bias", False)) or bool(config.get(fam.qkv_bias_key, fam.qkv_bias_default))


# LlamaConfig's defaults for the sizes (Llama 2 7B's)
_LLAMA_CONFIG_SIZES = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                       "num_attention_heads": 32}
# what a vision-language config.json may carry beside its text_config, for the language model
_OUTER_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")


def _language_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's language model, as a text model's config.json would be:
    its `text_config`, with the token ids and embedding tying the outer config states where
    the text_config does not (Gemma 3 keeps eos_token_id outside)."""
    arch = (config.get("architectures") or [config.get("model_type")])[0]
    text = config.get("text_config")
    if text is None and arch in FLAT_TEXT_CONFIG_ARCHITECTURES:  # the language model's keys at the top
        text = {key: value for key, value in config.items() if key != "vision_config"}
    if not isinstance(text, dict):
        raise ValueError(f"a {arch} config.json needs a `text_config` (the language model's config, which ember "
                         "serves): the file is incomplete; take config.json from the original checkpoint again")
    if arch in TEXT_CONFIG_FAMILY_ARCHITECTURES and text.get("model_type", "llama") == "llama":
        text = _LLAMA_CONFIG_SIZES | text  # llava-hf's LLaVA text_configs leave LlamaConfig's sizes unsaid
    missing = [key for key in _TEXT_CONFIG_REQUIRED if key not in text]
    if missing:
        raise ValueError(f"the text_config of this {arch} config.json lacks {', '.join(missing)}: no default stands "
                         "in for the language model's sizes; take config.json from the original checkpoint again, "
                         "or add them to its text_config")
    outer = {key: config[key] for key in _OUTER_KEYS if config.get(key) is not None}
    return outer | {key: value for key, value in text.items() if value is not None or key not in outer}


# HF activation names -> ember's
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh"}


def _layer_norm_decoder_config(config: dict[str, Any], fam: Family) -> dict[str, Any]:
    """A GPT-2, OPT or Phi config.json under the keys ember reads (GPT-2's n_embd is
    hidden_size, ...), after refusing the options ember does not run."""
    arch = (config.get("architectures") or [fam.name])[0]
    refused = {
        "scale_attn_by_inverse_layer_idx": "attention scores divided by the layer index",
        "add_cross_attention": "cross-attention",
        "qk_layernorm": "LayerNorm on q and k",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{arch} with {key} ({what}) is not supported: ember runs the standard {fam.name} blocks")
    if config.get("scale_attn_weights") is False:
        raise ValueError(f"{arch} with scale_attn_weights false (unscaled attention scores) is not supported")
    if config.get("do_layer_norm_before") is False or config.get("layer_norm_elementwise_affine") is False:
        raise ValueError(f"{arch} with do_layer_norm_before / layer_norm_elementwise_affine false (OPT-350m's "
                         "post-norm blocks) is not supported: ember runs OPT's pre-norm blocks (opt-125m, 1.3b and up)")
    projection = config.get("word_embed_proj_dim")
    if projection is not None and projection != config.get("hidden_size"):
        raise ValueError(f"{arch} with word_embed_proj_dim {projection} != hidden_size (OPT-350m's projections in "
                         "and out of the embedding) is not supported")
    config = fam.hf_config_defaults | {fam.hf_config_keys.get(k, k): v for k, v in config.items()}
    if config.get("intermediate_size") is None:  # GPT-2's n_inner null: 4 x n_embd
        config["intermediate_size"] = 4 * config["hidden_size"]
    return config


def _layer_norm_options(fam: Family) -> dict[str, Any]:
    if not fam.layer_norm:
        return {}
    learned = fam.learned_positions is not None
    return {"layer_norm": True, "gated_mlp": False, "learned_positions": learned,
            "position_offset": fam.learned_positions or 0, "parallel_block": fam.parallel_block,
            "lm_head_bias": fam.lm_head_bias}


def _rope_parameters(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the global RoPE's parameters, the sliding layers' own or None), from either spelling:
    `rope_scaling` + `rope_theta` (+ Gemma 3's `rope_local_base_freq`), or transformers 5's
    `rope_parameters`, nested by layer type where the types differ."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope.get("full_attention") or {}, rope.get("sliding_attention")
    return rope, None


def _mrope(rope: dict[str, Any], vision: VisionConfig | None) -> dict[str, Any]:
    """Qwen2-VL's M-RoPE sections (t, h, w) from its RoPE parameters (transformers' defaults
    [16, 24, 24], Qwen3-VL's [24, 20, 20], where they name none), and whether they interleave
    (Qwen3-VL's always do, as transformers' Qwen3-VL turns them); {} for a model without M-RoPE."""
    if vision is None or not vision.dynamic_resolution:
        if rope.get("mrope_section") is not None or (rope.get("type") or rope.get("rope_type")) == "mrope":
            raise ValueError("M-RoPE (mrope_section) is supported for Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints "
                             "only")
        return {}
    interleaved = vision.kind == "qwen3_vl"
    if rope.get("mrope_interleaved", interleaved) != interleaved:
        raise ValueError(f"mrope_interleaved {rope['mrope_interleaved']} is not supported for {vision.kind}: ember "
                         f"runs {'Qwen3-VL' if interleaved else 'Qwen2-VL'}'s M-RoPE "
                         f"({'interleaved' if interleaved else 'sectioned'}), as transformers does")
    section = tuple(int(x) for x in rope.get("mrope_section") or ((24, 20, 20) if interleaved else (16, 24, 24)))
    if len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must have three entries (t, h, w)")
    return {"mrope_section": section, "mrope_interleaved": interleaved}


def _gguf_mrope(md: dict[str, Any], arch: str, interleaved: bool) -> dict[str, Any]:
    """M-RoPE of llama.cpp's Qwen-VL language models (qwen2vl, qwen3vl: interleaved): the (t, h, w)
    sections of rope.dimension_sections, whose fourth (llama.cpp's, for no model ember runs) is 0.
    On text alone the three positions are equal: plain RoPE."""
    key = f"{arch}.rope.dimension_sections"
    sections = [int(x) for x in md.get(key) or ()]
    if len(sections) not in (3, 4) or sections[3:] not in ([], [0]):
        raise ValueError(f"GGUF metadata {key} {sections} is not (t, h, w[, 0]) M-RoPE sections: convert the file "
                         "again with llama.cpp's convert_hf_to_gguf.py")
    return {"mrope_section": tuple(sections[:3]), "mrope_interleaved": interleaved}


def _rope_scaling(rope: dict[str, Any], config: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "su":  # Phi-3's first name for longrope
        kind = "longrope"
    if kind == "mrope":  # Qwen2-VL's hub configs: M-RoPE (mrope_section, read apart) over the default RoPE
        kind = "default"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; ember supports {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return None
    try:
        original = rope.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
        if kind == "longrope":
            # Phi-3 keeps the trained length beside the RoPE parameters, and it wins (as in transformers)
            original = config.get("original_max_position_embeddings") or original
        factor = rope.get("factor")
        if factor is None and kind in ("yarn", "longrope") and original:
            factor = config["max_position_embeddings"] / original
        return RopeScaling(
            kind=kind,
            factor=float(factor if factor is not None else 1.0),
            original_max_position_embeddings=int(original or config.get("max_position_embeddings", 4096)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            attention_factor=rope.get("attention_factor"),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            truncate=bool(rope.get("truncate", True)),
            short_factor=tuple(float(x) for x in rope.get("short_factor") or ()),
            long_factor=tuple(float(x) for x in rope.get("long_factor") or ()),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"rope_scaling {rope!r} is incomplete or malformed for type {kind!r} ({e})") from None


def _moe_options(config: dict[str, Any], fam: Family, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields. Mixtral: every layer sparse, its experts of
    intermediate_size, top-k renormalized. Qwen3-MoE: layer i sparse unless it is among
    mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (those keep a dense
    MLP of intermediate_size); experts of moe_intermediate_size; renormalized per norm_topk_prob.
    Qwen2-MoE: Qwen3-MoE's rule, and a shared expert."""
    if fam.moe == "mixtral":
        return {"moe_layers": (True,) * num_layers, "num_experts": config["num_local_experts"],
                "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["intermediate_size"], "norm_topk_prob": True}
    if fam.moe == "deepseek":
        return _deepseek_moe_options(config, num_layers)
    if fam.moe == "gpt_oss":
        return {"moe_layers": (True,) * num_layers, "num_experts": config["num_local_experts"],
                "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["intermediate_size"], "norm_topk_prob": True, "moe_bias": True,
                "swiglu": (float(config["swiglu_alpha"]), float(config["swiglu_limit"])),
                "mxfp4_experts": (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"}
    if fam.moe == "llama4":
        step = config.get("interleave_moe_layer_step") or 1
        at = config.get("moe_layers")
        sparse = set(range(step - 1, num_layers, step) if at is None else at)
        size = config["moe_intermediate_size"]
        return {"moe_layers": tuple(i in sparse for i in range(num_layers)) if sparse else None,
                "num_experts": config["num_local_experts"], "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": size, "norm_topk_prob": False, "shared_expert_intermediate_size": size,
                "shared_expert_gate": False, "moe_input_scaled": True}
    if fam.moe == "qwen":
        dense, step = set(config.get("mlp_only_layers") or ()), config.get("decoder_sparse_step", 1)
        # transformers 5.25 saves Qwen3-MoE's expert count as num_local_experts
        experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        return {"moe_layers": sparse if any(sparse) else None, "num_experts": experts,
                "num_experts_per_tok": config["num_experts_per_tok"],
                "moe_intermediate_size": config["moe_intermediate_size"],
                "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                "shared_expert_intermediate_size": config["shared_expert_intermediate_size"]
                if fam.shared_expert else 0}
    return {}


def _linear_attention_options(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's gated DeltaNet layers: those layer_types calls "linear_attention" (without
    layer_types: all but every full_attention_interval-th, as Qwen3NextConfig fills it), and their sizes."""
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if set(types) - {"linear_attention", "full_attention"} or len(types) != num_layers:
        raise ValueError(f"layer_types must list 'linear_attention' or 'full_attention' for each of the {num_layers} "
                         f"layers; got {types!r}")
    return {"linear_layers": tuple(t == "linear_attention" for t in types),
            "linear_num_key_heads": config["linear_num_key_heads"],
            "linear_num_value_heads": config["linear_num_value_heads"],
            "linear_key_head_dim": config["linear_key_head_dim"],
            "linear_value_head_dim": config["linear_value_head_dim"],
            "linear_conv_kernel": config["linear_conv_kernel_dim"]}


def _gguf_linear_attention_options(md: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's linear layers from llama.cpp's keys: attention.recurrent_layers (else all but
    every full_attention_interval-th), and the sizes under ssm.*: group_count key heads of
    state_size dims, time_step_rank value heads sharing inner_size, conv_kernel."""
    def get(key: str) -> Any:
        if (value := md.get(f"{arch}.{key}")) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = md.get(f"{arch}.full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    heads = get("ssm.time_step_rank")
    return {"linear_layers": tuple(bool(r) for r in recurrent[:num_layers]),
            "linear_num_key_heads": get("ssm.group_count"), "linear_num_value_heads": heads,
            "linear_key_head_dim": get("ssm.state_size"), "linear_value_head_dim": get("ssm.inner_size") // heads,
            "linear_conv_kernel": get("ssm.conv_kernel")}


def _deepseek_moe_options(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """DeepSeekMoE: the first first_k_dense_replace layers dense (intermediate_size), then
    every moe_layer_freq-th sparse, over n_routed_experts of moe_intermediate_size and
    n_shared_experts beside them (one MLP of their summed size, ungated). The router scores
    by softmax (V2) or sigmoid (V3, its e_score_correction_bias added for the choice only);
    topk_method group_limited_greedy (V2) or noaux_tc (V3) picks within topk_group of n_group
    groups, greedy among all."""
    experts, first, freq = config["n_routed_experts"], config.get("first_k_dense_replace", 0), \
        config.get("moe_layer_freq", 1)
    sparse = tuple(bool(experts) and i >= first and i % freq == 0 for i in range(num_layers))
    method, scoring = config["topk_method"], config["scoring_func"]
    if method not in ("greedy", "group_limited_greedy", "noaux_tc") or scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"DeepSeek routing topk_method {method!r} with scoring_func {scoring!r} is not supported: "
                         "ember routes greedy / group_limited_greedy by softmax and noaux_tc by sigmoid")
    if (method == "noaux_tc") != (scoring == "sigmoid"):
        raise ValueError(f"DeepSeek routing topk_method {method!r} with scoring_func {scoring!r}: ember runs "
                         "noaux_tc with sigmoid (V3) and the others with softmax (V2)")
    grouped = method != "greedy"
    return {"moe_layers": sparse if any(sparse) else None, "num_experts": experts,
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "norm_topk_prob": bool(config["norm_topk_prob"]),
            "shared_expert_intermediate_size": config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0),
            "shared_expert_gate": False, "moe_scoring": scoring,
            "moe_groups": config.get("n_group") or 1 if grouped else 1,
            "moe_topk_groups": config.get("topk_group") or 1 if grouped else 1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0)}


def _mla_options(config: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's sizes, and the scale DeepSeek's YaRN puts on every score
    (mscale(factor, mscale_all_dim) squared, as transformers' yarn_apply_mscale)."""
    factor = 1.0
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default" and rope.get("mscale_all_dim"):
        scale = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(scale) + 1.0 if scale > 1 else 1.0
        factor = mscale * mscale
    return {"kv_lora_rank": config["kv_lora_rank"], "q_lora_rank": config.get("q_lora_rank") or 0,
            "qk_nope_head_dim": config["qk_nope_head_dim"], "v_head_dim": config["v_head_dim"],
            "attention_scale_factor": factor, "rope_interleaved": bool(config.get("rope_interleave", True))}


def _gguf_mla_options(md: dict[str, Any], arch: str, rope_scaling: RopeScaling | None
                      ) -> tuple[dict[str, Any], RopeScaling | None]:
    """MLA's sizes from llama.cpp's deepseek2 keys (its converter writes the latent attention as
    multi-query attention: key_length r + rope, key_length_mla a query head's nope + rope), and
    its YaRN as llama.cpp runs it: cos and sin unscaled, every score times mscale squared,
    mscale = 1 + yarn_log_multiplier * ln(factor) (0.1 * mscale_all_dim, the converter writes)."""
    def get(key: str) -> Any:
        if (value := md.get(f"{arch}.{key}")) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    rank, rope = get("attention.kv_lora_rank"), get("rope.dimension_count")
    head_dim = get("attention.key_length_mla")
    factor = 1.0
    if rope_scaling is not None and rope_scaling.kind == "yarn":
        log_mul = float(md.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
        if log_mul:
            mscale = 1.0 + log_mul * math.log(rope_scaling.factor) if rope_scaling.factor > 1 else 1.0
            factor = mscale * mscale
        rope_scaling = dataclasses.replace(rope_scaling, attention_factor=1.0)
    return {"kv_lora_rank": rank, "q_lora_rank": md.get(f"{arch}.attention.q_lora_rank") or 0,
            "qk_nope_head_dim": head_dim - rope, "v_head_dim": get("attention.value_length_mla"),
            "attention_scale_factor": factor, "rope_interleaved": True, "head_dim": head_dim}, rope_scaling


def _gguf_gpt_oss_options(md: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """gpt-oss's experts from llama.cpp's keys: every layer sparse, expert_count of
    expert_feed_forward_length, expert_used_count a token, biased, the clamped SwiGLU at the
    constants llama.cpp's graph fixes (alpha 1.702, limit 7)."""
    def get(key: str) -> Any:
        if (value := md.get(f"{arch}.{key}")) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    return {"moe_layers": (True,) * num_layers, "num_experts": get("expert_count"),
            "num_experts_per_tok": get("expert_used_count"), "moe_intermediate_size": get("expert_feed_forward_length"),
            "norm_topk_prob": True, "moe_bias": True, "swiglu": (1.702, 7.0)}


def _gguf_llama4_options(md: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """Llama 4 as llama.cpp reads its GGUF: experts (expert_count of expert_feed_forward_length,
    the shared one as large) in every interleave_moe_layer_step-th layer; and what llama.cpp
    fixes rather than reads: every fourth layer NoPE and global, the others chunked by 8192,
    temperature tuning (0.1, 8192), q/k norms unless 128 experts (Maverick). A file whose
    attention.sliding_window is 0 (MobileLLM-R1) has RoPE and global attention everywhere."""
    def get(key: str) -> Any:
        if (value := md.get(f"{arch}.{key}")) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
        return value

    experts, step, size = get("expert_count"), get("interleave_moe_layer_step"), get("expert_feed_forward_length")
    options = _chunked_nope_options({"use_qk_norm": experts != 128, "attn_temperature_tuning": True,
                                     "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "floor_scale": 8192,
                                     "attn_scale": 0.1}, num_layers)
    if md.get(f"{arch}.attention.sliding_window") == 0:
        options |= {"nope_layers": None, "layer_chunks": None, "attn_temperature": None}
    options["rope_interleaved"] = False  # the loader's un-permuting gives rotate-half already
    return options | {
        "moe_layers": tuple((i + 1) % step == 0 for i in range(num_layers)), "num_experts": experts,
        "num_experts_per_tok": get("expert_used_count"), "moe_intermediate_size": size, "norm_topk_prob": False,
        "shared_expert_intermediate_size": size, "shared_expert_gate": False, "moe_input_scaled": True}


def _gguf_deepseek_moe_options(md: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """DeepSeekMoE from llama.cpp's keys: leading_dense_block_count dense layers, then experts
    (expert_count of expert_feed_forward_length; expert_shared_count shared ones), routed by
    expert_gating_func (1 softmax, 2 sigmoid) within expert_group_used_count of
    expert_group_count groups, weights renormalized where expert_weights_norm, scaled by
    expert_weights_scale."""
    experts = md.get(f"{arch}.expert_count") or 0
    dense = int(md.get(f"{arch}.leading_dense_block_count", 0))
    gating = md.get(f"{arch}.expert_gating_func", 1)
    if gating not in (1, 2):
        raise ValueError(f"{arch}.expert_gating_func {gating}: ember routes DeepSeek's experts by softmax (1) or "
                         "sigmoid (2)")
    inter = md.get(f"{arch}.expert_feed_forward_length") or 0
    sparse = tuple(bool(experts) and i >= dense for i in range(num_layers))
    groups = md.get(f"{arch}.expert_group_count") or 1
    return {"moe_layers": sparse if any(sparse) else None, "num_experts": experts,
            "num_experts_per_tok": md.get(f"{arch}.expert_used_count") or 0, "moe_intermediate_size": inter,
            "norm_topk_prob": bool(md.get(f"{arch}.expert_weights_norm", False)),
            "shared_expert_intermediate_size": inter * (md.get(f"{arch}.expert_shared_count") or 0),
            "shared_expert_gate": False, "moe_scoring": "softmax" if gating == 1 else "sigmoid",
            "moe_groups": groups, "moe_topk_groups": md.get(f"{arch}.expert_group_used_count") or groups,
            "routed_scaling_factor": float(md.get(f"{arch}.expert_weights_scale") or 1.0)}


def _gguf_moe_options(md: dict[str, Any], arch: str, num_layers: int, ff: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (and `family`) from llama.cpp's keys: expert_count,
    expert_used_count, expert_feed_forward_length (the experts' intermediate size; llama.cpp's
    fallbacks where it lacks: llama's feed_forward_length, the Qwen MoEs' feed_forward_length /
    expert_used_count), expert_shared_feed_forward_length (qwen2moe's shared expert), and
    leading_dense_block_count (the first layers' MLP dense; 0 where it lacks, as the converter
    writes these architectures: llama.cpp's graphs for them have no dense layer)."""
    experts = md.get(f"{arch}.expert_count") or 0
    fam = BY_GGUF_EXPERTS.get(arch)
    if not experts:
        if BY_GGUF_ARCHITECTURE[arch].moe:
            raise ValueError(f"GGUF metadata lacks {arch}.expert_count: the file is incomplete")
        return {}
    if fam is None:
        raise ValueError(f"this {arch} GGUF is a mixture of {experts} experts, which ember reads from GGUF "
                         "architectures llama (Mixtral), qwen3moe and qwen2moe only: pass the model's HF directory")
    gating = md.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"{arch}.expert_gating_func {gating}: ember routes experts by softmax (1) only")
    scale = md.get(f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ValueError(f"{arch}.expert_weights_scale {scale}: ember does not scale the routing weights")
    used = md.get(f"{arch}.expert_used_count")
    if not used:
        raise ValueError(f"GGUF metadata lacks {arch}.expert_used_count: the file is incomplete")
    dense = int(md.get(f"{arch}.leading_dense_block_count", 0))
    inter = md.get(f"{arch}.expert_feed_forward_length") or (ff if fam.moe == "mixtral" else ff // used)
    shared = (md.get(f"{arch}.expert_shared_feed_forward_length") or ff) if fam.shared_expert else 0
    return {"family": fam.name,
            "moe_layers": tuple(i >= dense for i in range(num_layers)), "num_experts": experts,
            "num_experts_per_tok": used, "moe_intermediate_size": inter,
            "norm_topk_prob": bool(md.get(f"{arch}.expert_weights_norm", fam.gguf_topk_norm)),
            "shared_expert_intermediate_size": shared}


def _chunked_nope_options(config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Llama 4's layers, as transformers' Llama4TextConfig reads them: `no_rope_layers` (1: the
    layer has RoPE; empty or absent: every no_rope_layer_interval-th layer has none), each
    layer's `layer_types` (chunked_attention or full_attention; by default the RoPE layers
    are chunked where attention_chunk_size is set), q/k L2 norms on the RoPE layers where
    use_qk_norm, temperature tuning on the others where attn_temperature_tuning."""
    interval = config.get("no_rope_layer_interval", 4)
    rope = config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    chunk = config.get("attention_chunk_size")
    types = config.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                          for r in rope]
    if len(rope) < num_layers or len(types) != num_layers or set(types) - {"chunked_attention", "full_attention"}:
        raise ValueError(f"no_rope_layers ({len(rope)}) and layer_types ({types!r}) must cover the {num_layers} "
                         "layers, each type chunked_attention or full_attention")
    if "chunked_attention" in types and not chunk:
        raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set")
    nope = tuple(not r for r in rope[:num_layers])
    chunks = tuple(int(chunk) if t == "chunked_attention" else None for t in types)
    temperature = (float(config.get("attn_scale", 0.1)), float(config.get("floor_scale", 8192))) \
        if config.get("attn_temperature_tuning") and any(nope) else None
    return {"nope_layers": nope if any(nope) else None, "layer_chunks": chunks if any(chunks) else None,
            "attn_temperature": temperature, "qk_l2_norm": bool(config.get("use_qk_norm")),
            "rope_interleaved": True}  # its RoPE turns interleaved pairs: the loader reorders q and k


def _layer_windows(config: dict[str, Any], fam: Family, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window: from `layer_types` where config.json lists them, else
    each family's rule (Gemma 2: every other layer, from the first; Gemma 3: all but every
    sixth; Qwen2/3 with use_sliding_window: layers from max_window_layers on; Mistral, Phi-3:
    every layer)."""
    window = config.get("sliding_window")
    if fam.qwen_windows and not config.get("use_sliding_window", False):
        window = None
    if not window:
        return None
    types = config.get("layer_types")
    if types is not None:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown or len(types) != num_layers:
            raise ValueError(
                f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {num_layers} "
                f"layers; got {types!r}"
            )
        sliding = [t == "sliding_attention" for t in types]
    elif fam.sliding_pattern is not None:
        pattern = config.get(fam.sliding_pattern_key, fam.sliding_pattern) if fam.sliding_pattern_key \
            else fam.sliding_pattern
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif fam.qwen_windows:
        first = config.get("max_window_layers", num_layers)
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    windows = tuple(int(window) if s else None for s in sliding)
    return windows if any(w is not None for w in windows) else None


def _gguf_layer_windows(md: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window, as llama.cpp reads a GGUF: `attention.sliding_window`
    (Gemma 2's 4096 where the key lacks), and for Gemma which layers slide:
    `attention.sliding_window_pattern`, one flag per layer or n (each n-th layer global; 2
    for Gemma 2 and 6 for Gemma 3 where the key lacks; 0: every layer slides)."""
    fam = BY_GGUF_ARCHITECTURE[arch]
    window = md.get(f"{arch}.attention.sliding_window", fam.gguf_default_window)
    if not window:
        return None
    if fam.sliding_pattern is None:
        return _layer_windows({"sliding_window": window}, fam, num_layers)
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = md.get(key, fam.sliding_pattern)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"GGUF metadata {key} has {len(pattern)} flags for {num_layers} layers: the file is "
                             "corrupt, convert it again")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]
    windows = tuple(int(window) if s else None for s in sliding)
    return windows if any(w is not None for w in windows) else None


def _gguf_rope_scaling(md: dict[str, Any], arch: str, tensor_names: list[str],
                       vector: Callable[[str], tuple[float, ...]]) -> RopeScaling | None:
    """llama.cpp's RoPE scaling: keys for linear and YaRN; tensors for Llama 3 (rope_freqs:
    each frequency's divisor) and LongRoPE (rope_factors_short / _long)."""
    if "rope_freqs.weight" in tensor_names:
        return RopeScaling("freq_factors", freq_factors=vector("rope_freqs.weight"))
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensor_names:
        if not original:
            raise ValueError(f"a GGUF with LongRoPE factors needs {arch}.rope.scaling.original_context_length (the "
                             "trained context, where the long factors begin); this file lacks it: convert it again")
        return RopeScaling("longrope", factor=md[f"{arch}.context_length"] / original,
                           original_max_position_embeddings=original,
                           attention_factor=md.get(f"{arch}.rope.scaling.attn_factor"),
                           short_factor=vector("rope_factors_short.weight"), long_factor=vector("rope_factors_long.weight"))
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=int(original),
                           beta_fast=float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)))
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}; ember reads none, linear, yarn, "
                     "and the llama3 / longrope factors stored as tensors")
