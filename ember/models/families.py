"""The model families ember runs, one row each: what sets a family apart from Llama, for
every reader of a checkpoint (ModelConfig from a config.json or from GGUF metadata, the HF
weight names, the GGUF loader). A family that differs only in these is one new row; a
difference no field here covers is a new field, read where it matters. Every decoder family
runs on models/llama.py's layers (ModelConfig's fields say how), the encoders on models/bert.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json `architectures[0]`
    hf_model_types: tuple[str, ...]  # config.json `model_type`, for a file without `architectures`
    # llama.cpp's general.architecture for it; None: its GGUFs say another's (a Mixtral GGUF
    # says "llama", with experts)
    gguf_architecture: str | None
    # llama.cpp's architecture for the language model of the family's vision-language checkpoints
    # and whether its M-RoPE interleaves: the family's layers, M-RoPE's sections in
    # rope.dimension_sections (Qwen2-VL's "qwen2vl" in turn, Qwen3-VL's "qwen3vl" interleaved)
    gguf_mrope: tuple[str, bool] | None = None
    # Gemma: norms apply (1 + w), embeddings times sqrt(hidden), tied embeddings by default,
    # GeGLU (config.json's legacy "gelu" meaning the tanh one), the query scalar and soft caps read
    gemma: bool = False
    sandwich_norms: bool = False  # Gemma 2/3: a norm on each sublayer's output too (Gemma 1: none)
    qk_norm: bool = False  # HF: per-head RMSNorm on q and k (GGUF: where the file has the tensors)
    qk_norm_key: str | None = None  # the config.json key that turns them on (GLM-4.5's use_qk_norm)
    # q/k/v biases: the config.json key that says so and its default (None: always, Qwen2)
    qkv_bias_key: str | None = "attention_bias"
    qkv_bias_default: bool = False
    rope_theta: float = 10000.0  # where a config.json or GGUF names no RoPE base
    partial_rotary_factor: float = 1.0  # where neither config.json nor its RoPE parameters name one
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base, by default
    # which layers slide: every n-th layer attends globally (Gemma: config.json's
    # sliding_window_pattern or llama.cpp's key, else this); Qwen: sliding_window applies only
    # with use_sliding_window, from max_window_layers on; else every layer slides
    sliding_pattern: int | None = None
    sliding_pattern_key: str | None = None  # the config.json key that may set it (Gemma 2's is fixed)
    qwen_windows: bool = False
    gguf_default_window: int | None = None  # llama.cpp's window where a Gemma 2 GGUF has no key
    # llama.cpp's soft caps where a Gemma 2 GGUF has no key (attention, final); Gemma 3: none
    gguf_softcaps: tuple[float | None, float | None] = (None, None)
    # llama.cpp scales queries by hidden / heads for this layer count (the 27B models), else head_dim
    gguf_hidden_query_scale_layers: int | None = None
    # experts: "mixtral" (every layer sparse, w1/w2/w3 under block_sparse_moe), "qwen"
    # (mlp_only_layers, decoder_sparse_step, gate/up/down_proj under mlp), "deepseek" (dense
    # first_k_dense_replace layers, shared experts, grouped routing: models/config.py) or
    # "gpt_oss" (every layer sparse; a router and experts with biases, the clamped SwiGLU, the
    # experts stacked in one tensor each, dense or MXFP4) or "llama4" (every
    # interleave_moe_layer_step-th layer sparse, top-1 with a sigmoid score on the expert's
    # input, an ungated shared expert, the experts stacked [E, in, out])
    moe: str | None = None
    shared_expert: bool = False  # Qwen2-MoE: a gated shared expert beside the routed ones
    # GGUF: llama.cpp's top-k renormalization (build_moe_ffn's norm_w): its graphs fix it and
    # its converter writes no key (expert_weights_norm, where a file has it, wins); and the
    # architecture whose files with experts are this family (a Mixtral GGUF says "llama")
    gguf_topk_norm: bool = True
    gguf_experts_of: str | None = None
    # checkpoints store q|k|v and (a gated MLP's) gate|up merged: Phi-3; GPT-2's q|k|v
    fused_projections: bool = False
    # llama.cpp's converter permutes Q and K rows for its adjacent-pair RoPE (the GGUF loader
    # undoes it, for whole-head RoPE only)
    gguf_rope_permuted: bool = False
    # what transformers' config class fills where a config.json is silent (Gemma 3's text_config)
    hf_config_defaults: dict[str, Any] = field(default_factory=dict)
    # an encoder (BERT, XLM-RoBERTa): bidirectional attention over the whole prompt, learned
    # absolute positions, post-norm LayerNorm blocks (models/bert.py); it embeds and classifies
    encoder: bool = False
    position_offset_from_pad: bool = False  # RoBERTa: positions count from pad_token_id + 1
    # the LayerNorm decoders (GPT-2, OPT, Phi-2): LayerNorm with a bias in place of RMSNorm, a
    # bias on every projection, and an MLP of fc1, act, fc2 (not gated)
    layer_norm: bool = False
    learned_positions: int | None = None  # a table of absolute positions, no RoPE: its offset (OPT: 2)
    parallel_block: bool = False  # Phi-2: x + attn(norm(x)) + mlp(norm(x)), one norm a layer
    lm_head_bias: bool = False  # Phi-2
    conv1d_weights: bool = False  # GPT-2: HF stores its projections as Conv1D, [in, out]
    tied_default: bool = False  # tie_word_embeddings where config.json is silent (transformers omits its default)
    # config.json's own names for the keys ember reads (GPT-2's n_embd for hidden_size, ...)
    hf_config_keys: dict[str, str] = field(default_factory=dict)
    # the checkpoint's tensor names -> ember's (regex, replacement), in order; None: not read
    hf_tensor_names: tuple[tuple[str, str | None], ...] = ()
    # multi-head latent attention (DeepSeek-V2/V3); its RoPE dims stored as interleaved pairs
    # (V3: unless config.json's rope_interleave is false)
    mla: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned softmax logit a head (self_attn.sinks)
    o_proj_bias_key: str | None = None  # the config.json key that gives o_proj a bias too (gpt-oss's attention_bias)
    # Llama 4: chunked local attention on the RoPE layers, NoPE layers between them (global,
    # temperature-tuned queries), q/k L2 norms (models/config.py's Llama 4 fields)
    chunked_nope: bool = False
    unit_offset_norms: bool = False  # norms scale by (1 + w), without Gemma's other traits (Qwen3-Next)
    # Qwen3-Next: q_proj gives each head's query and a gate, the attention output times sigmoid(gate)
    attention_output_gate: bool = False
    # Qwen3-Next: gated DeltaNet linear-attention layers (models/gated_deltanet.py) where config.json's
    # layer_types says "linear_attention" (else every full_attention_interval-th layer is full attention)
    linear_attention: bool = False


# What transformers' Gemma3TextConfig fills where a config.json is silent (as transformers
# 5.24 has them): Google's Gemma 3 4B/12B/27B text_configs state little more than their
# sizes.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}

# Llama 4 (text): the experts under mlp, stacked [E, in, out] (loader/weights.py turns them to
# FusedMoE's [E, out, in]), the router as its gate
_LLAMA4_NAMES = (
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.gate_up_proj$", r"model.layers.\1.mlp.w13"),
    (r"model\.layers\.(\d+)\.feed_forward\.experts\.down_proj$", r"model.layers.\1.mlp.w2"),
    (r"model\.layers\.(\d+)\.feed_forward\.router\.", r"model.layers.\1.mlp.gate."),
    (r"model\.layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."),
)
# what transformers' Llama4TextConfig fills where a config.json is silent (transformers 5.25)
_LLAMA4_TEXT_DEFAULTS = {
    "intermediate_size_mlp": 16384, "num_experts_per_tok": 1, "num_local_experts": 16, "rms_norm_eps": 1e-5,
    "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
    "floor_scale": 8192, "attn_scale": 0.1, "head_dim": 128, "bos_token_id": 1, "eos_token_id": 2,
}

# GPT-2's checkpoints, with or without the `transformer.` prefix (the original gpt2 has none)
_GPT2_NAMES = (
    (r"(?:transformer\.)?h\.(\d+)\.attn\.(?:bias|masked_bias)$", None),  # old files' causal-mask buffers
    (r"(?:transformer\.)?h\.(\d+)\.ln_1\.", r"model.layers.\1.input_layernorm."),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.", r"model.layers.\1.self_attn.qkv_proj."),
    (r"(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"(?:transformer\.)?h\.(\d+)\.ln_2\.", r"model.layers.\1.post_attention_layernorm."),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.", r"model.layers.\1.mlp.fc1."),
    (r"(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.", r"model.layers.\1.mlp.fc2."),
    (r"(?:transformer\.)?wte\.", "model.embed_tokens."),
    (r"(?:transformer\.)?wpe\.", "model.embed_positions."),
    (r"(?:transformer\.)?ln_f\.", "model.norm."),
)
# OPT's, from OPTForCausalLM or (facebook/opt-125m's own files) its base model, decoder.*
_OPT_NAMES = (
    (r"(?:model\.)?decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\1.self_attn.o_proj."),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"model.layers.\1.input_layernorm."),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.final_layer_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"(?:model\.)?decoder\.layers\.(\d+)\.(fc1|fc2)\.", r"model.layers.\1.mlp.\2."),
    (r"(?:model\.)?decoder\.final_layer_norm\.", "model.norm."),
    (r"(?:model\.)?decoder\.", "model."),
)
_PHI_NAMES = (
    (r"model\.layers\.(\d+)\.self_attn\.dense\.", r"model.layers.\1.self_attn.o_proj."),
    (r"model\.final_layernorm\.", "model.norm."),
)

_DEEPSEEK_NAMES = ((r"model\.layers\.(\d+)\.mlp\.shared_experts\.", r"model.layers.\1.mlp.shared_expert."),)

# gpt-oss: the router is mlp.gate here; the stacked experts (dense, or MXFP4 blocks and scales,
# which loader/weights.py decodes) are FusedMoE's w13 / w2 and their biases
_GPT_OSS_NAMES = (
    (r"model\.layers\.(\d+)\.mlp\.router\.", r"model.layers.\1.mlp.gate."),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias$", r"model.layers.\1.mlp.w13_bias"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$", r"model.layers.\1.mlp.w13"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj_bias$", r"model.layers.\1.mlp.w2_bias"),
    (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj$", r"model.layers.\1.mlp.w2"),
)

# Qwen3-Next's checkpoints carry a multi-token-prediction layer (mtp.*), which transformers does not read either
_QWEN3_NEXT_NAMES = ((r"mtp\.", None),)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM", "LlamaForSequenceClassification"), ("llama",), "llama",
           gguf_rope_permuted=True),
    Family("mistral", ("MistralForCausalLM", "MistralForSequenceClassification"), ("mistral",), "mistral"),
    # Mistral 3's language model as llama.cpp's converter writes it (Mistral3ForConditionalGeneration's
    # text GGUF, Q and K permuted as llama's); its HF checkpoints are the mistral family's (text_config)
    Family("mistral3", (), (), "mistral3", gguf_rope_permuted=True),
    Family("qwen2", ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2VLForConditionalGeneration",
                     "Qwen2_5_VLForConditionalGeneration"), ("qwen2", "qwen2_vl", "qwen2_5_vl"), "qwen2",
           gguf_mrope=("qwen2vl", False), qkv_bias_key=None,
           qkv_bias_default=True, qwen_windows=True),
    Family("qwen3", ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3VLForConditionalGeneration"),
           ("qwen3", "qwen3_vl"), "qwen3", gguf_mrope=("qwen3vl", True), qk_norm=True, qwen_windows=True),
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), "gemma", gemma=True),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "gemma2", gemma=True, sandwich_norms=True, sliding_pattern=2,
           gguf_default_window=4096, gguf_softcaps=(50.0, 30.0), gguf_hidden_query_scale_layers=46),
    Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text", "gemma3"), "gemma3",
           gemma=True, sandwich_norms=True, qk_norm=True, rope_theta=1_000_000.0, local_rope_theta=10000.0, sliding_pattern=6,
           sliding_pattern_key="sliding_window_pattern",
           gguf_hidden_query_scale_layers=62, hf_config_defaults=_GEMMA3_TEXT_DEFAULTS),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), "phi3", fused_projections=True),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), None, moe="mixtral", gguf_experts_of="llama"),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", qk_norm=True, qwen_windows=True,
           moe="qwen"),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), "qwen2moe", qkv_bias_key="qkv_bias",
           qkv_bias_default=True, qwen_windows=True, moe="qwen", shared_expert=True, gguf_topk_norm=False),
    # llama.cpp writes V2, V3 and Kimi-K2 alike as deepseek2 (the routing in its keys)
    Family("deepseek_v2", ("DeepseekV2ForCausalLM",), ("deepseek_v2",), "deepseek2", moe="deepseek", mla=True,
           hf_config_defaults={"rms_norm_eps": 1e-6, "topk_method": "greedy", "scoring_func": "softmax",
                               "norm_topk_prob": False}, hf_tensor_names=_DEEPSEEK_NAMES),
    # Kimi-K2 is DeepSeek-V3's architecture
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3", "kimi_k2"), None, moe="deepseek", mla=True,
           hf_config_defaults={"rms_norm_eps": 1e-6, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                               "norm_topk_prob": True, "rope_interleave": True}, hf_tensor_names=_DEEPSEEK_NAMES),
    # GLM-4.5 / 4.6: Llama's attention (q/k/v biases, RoPE on half of each head, optional q/k
    # norms) over DeepSeek-V3's experts and router
    Family("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",), "glm4moe", moe="deepseek", qk_norm_key="use_qk_norm",
           hf_config_defaults={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True},
           hf_tensor_names=_DEEPSEEK_NAMES),
    # gpt-oss: attention sinks, every other layer a 128-token window, q/k/v/o biases, YaRN,
    # MXFP4 experts with the clamped SwiGLU
    Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), "gpt-oss", moe="gpt_oss", qkv_bias_key="attention_bias",
           qkv_bias_default=True, o_proj_bias_key="attention_bias", attention_sinks=True, rope_theta=150000.0,
           sliding_pattern=2, hf_config_defaults={"attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702},
           hf_tensor_names=_GPT_OSS_NAMES),
    # Llama 4 (text; the vision tower of its multimodal checkpoints is not read): experts
    # routed top-1 by a sigmoid score that scales the expert's input, a shared expert, chunked
    # attention and NoPE layers, RoPE over interleaved pairs (the loader reorders q and k)
    Family("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), ("llama4_text", "llama4"), "llama4",
           moe="llama4", chunked_nope=True, rope_theta=500000.0, gguf_rope_permuted=True,
           hf_config_keys={"intermediate_size": "moe_intermediate_size", "intermediate_size_mlp": "intermediate_size"},
           hf_config_defaults=_LLAMA4_TEXT_DEFAULTS, hf_tensor_names=_LLAMA4_NAMES),
    # Qwen3-Next: three gated DeltaNet layers to one gated full-attention layer (partial RoPE, q/k
    # norms), zero-centred norms, Qwen2-MoE's experts and gated shared expert
    Family("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",), "qwen3next", qk_norm=True, moe="qwen",
           shared_expert=True, o_proj_bias_key="attention_bias", unit_offset_norms=True,
           attention_output_gate=True, linear_attention=True, hf_tensor_names=_QWEN3_NEXT_NAMES,
           partial_rotary_factor=0.25,
           hf_config_defaults={"head_dim": 256, "norm_topk_prob": True,
                               "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                               "linear_num_key_heads": 16, "linear_num_value_heads": 32, "decoder_sparse_step": 1}),
    Family("gpt2", ("GPT2LMHeadModel",), ("gpt2",), "gpt2", qkv_bias_key=None, qkv_bias_default=True,
           layer_norm=True, learned_positions=0, conv1d_weights=True, tied_default=True, fused_projections=True,
           hf_config_keys={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                           "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
                           "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act"},
           hf_config_defaults={"vocab_size": 50257, "max_position_embeddings": 1024, "hidden_size": 768,
                               "num_hidden_layers": 12, "num_attention_heads": 12, "hidden_act": "gelu_new",
                               "rms_norm_eps": 1e-5, "bos_token_id": 50256, "eos_token_id": 50256},
           hf_tensor_names=_GPT2_NAMES),
    Family("opt", ("OPTForCausalLM",), ("opt",), None, qkv_bias_key="enable_bias", qkv_bias_default=True,
           layer_norm=True, learned_positions=2, tied_default=True,
           hf_config_keys={"ffn_dim": "intermediate_size", "activation_function": "hidden_act"},
           hf_config_defaults={"rms_norm_eps": 1e-5, "hidden_act": "relu"}, hf_tensor_names=_OPT_NAMES),
    Family("phi", ("PhiForCausalLM",), ("phi",), "phi2", qkv_bias_key=None, qkv_bias_default=True, layer_norm=True,
           parallel_block=True, lm_head_bias=True, hf_config_keys={"layer_norm_eps": "rms_norm_eps"},
           hf_config_defaults={"hidden_act": "gelu_new", "rms_norm_eps": 1e-5},
           hf_tensor_names=_PHI_NAMES),
    Family("bert", ("BertModel", "BertForSequenceClassification"), ("bert",), None, encoder=True),
    Family("xlm_roberta", ("XLMRobertaModel", "XLMRobertaForSequenceClassification", "RobertaModel",
                           "RobertaForSequenceClassification"), ("xlm-roberta", "roberta"), None, encoder=True,
           position_offset_from_pad=True),
)}

# config.json `architectures[0]` / `model_type` -> family
BY_HF_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
BY_HF_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
# llama.cpp's general.architecture -> family (its M-RoPE architectures too), and -> the family of
# its files with experts
BY_GGUF_ARCHITECTURE = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture} | \
    {f.gguf_mrope[0]: f for f in FAMILIES.values() if f.gguf_mrope}
BY_GGUF_EXPERTS = {f.gguf_experts_of or f.gguf_architecture: f for f in FAMILIES.values()
                   if f.moe and (f.gguf_experts_of or f.gguf_architecture)}
# vision-language checkpoints (by `architectures`, or `model_type`): the language model's
# config is their `text_config`, its tensors sit under `language_model`, beside a vision tower
VISION_LANGUAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Llama4ForConditionalGeneration",
                                 "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                 "Mistral3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                                 "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
# those whose language model is any family's: the family is their text_config's model_type's
# (LLaVA's Llama, Vicuna or Mistral; Mistral 3's Mistral)
TEXT_CONFIG_FAMILY_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                    "Mistral3ForConditionalGeneration")
VISION_LANGUAGE_MODEL_TYPES = ("gemma3", "llama4", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# those whose config.json may keep the language model's keys at its top level (the Qwen2-VL
# checkpoints on the hub, written before transformers nested them under text_config)
FLAT_TEXT_CONFIG_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
