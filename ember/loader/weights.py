"""Checkpoint tensors (HF names) -> model parameters, ending with a completeness check.

Every source (GGUF, safetensors, dummy) yields HF-named tensors; this file alone knows
how those names land on ember's merged parameters.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from ember.layers.quant.fp8 import FP8Tensor
from ember.layers.quant.gguf_blocks import BlockTensor
from ember.layers.quant.int_weight import IntTensor
from ember.layers.quant.w8a8 import W8A8Tensor
from ember.loader.kv_scales import kv_scale_target
from ember.models.config import ModelConfig
from ember.models.families import FAMILIES

# checkpoint projection -> (merged ember module, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Qwen3-Next's linear attention from a GGUF: q, k, v (loader/gguf.py cuts its q | k | v) and z
    # apart (an HF checkpoint's in_proj_qkvz holds all four)
    "in_proj_q": ("in_proj_qkvz", 0),
    "in_proj_k": ("in_proj_qkvz", 1),
    "in_proj_v": ("in_proj_qkvz", 2),
    "in_proj_z": ("in_proj_qkvz", 3),
}


# a mixture of experts' tensors (Mixtral's block_sparse_moe.*, Qwen3-MoE's mlp.*): the router
# -> mlp.gate, each expert's projections -> shards of the stacked mlp.w13 (gate 2e, up 2e + 1)
# and mlp.w2 (down e) of layers/moe.py
_EXPERT = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                 "w2": ("w2", None), "down_proj": ("w2", None)}
_MIXTRAL_ROUTER = re.compile(r"(.*)\.block_sparse_moe\.gate\.weight")

logger = logging.getLogger(__name__)

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, with its shape."""
    if cfg.bidirectional:
        from ember.models.bert import encoder_weight_shapes

        return encoder_weight_shapes(cfg)
    if cfg.layer_norm:
        return _layer_norm_decoder_shapes(cfg)
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if cfg.classifier == "score":  # a sequence classifier's head, in place of the LM head
        shapes["score.weight"] = (cfg.num_labels, h)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    fused = FAMILIES[cfg.architecture].fused_projections  # q|k|v and gate|up stored merged
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        # the order is the dummy weights' draw order: a dense layer's stays as it was
        dense = not cfg.layer_is_moe(i)
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        linear = cfg.layer_is_linear(i)
        if cfg.mla:
            shapes |= _latent_attention_shapes(cfg, p)
        elif linear:
            shapes |= _linear_attention_shapes(cfg, p)
        else:
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if dense:
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.mla:
            if dense:
                shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
        elif fused:
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            if not linear:  # Qwen3-Next's gated attention: each head's query, then its gate
                shapes |= {
                    p + "self_attn.q_proj.weight": (2 * q if cfg.attention_output_gate else q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                }
            if dense:
                shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
        if not dense:
            shapes |= _expert_shapes(cfg, p)
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        if linear:
            continue
        if cfg.attention_bias and not cfg.mla:
            shapes |= {p + "self_attn.q_proj.bias": (2 * q if cfg.attention_output_gate else q,),
                       p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
    return shapes


def _latent_attention_shapes(cfg: ModelConfig, layer: str) -> dict[str, tuple[int, ...]]:
    """Multi-head latent attention's tensors (models/mla.py), as DeepSeek's checkpoints name them."""
    h, heads, rank, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.rotary_dim
    p = layer + "self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        shapes |= {p + "q_a_proj.weight": (cfg.q_lora_rank, h), p + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                   p + "q_b_proj.weight": (heads * cfg.head_dim, cfg.q_lora_rank)}
    else:
        shapes[p + "q_proj.weight"] = (heads * cfg.head_dim, h)
    shapes |= {p + "kv_a_proj_with_mqa.weight": (rank + rope, h), p + "kv_a_layernorm.weight": (rank,),
               p + "kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), rank),
               p + "o_proj.weight": (h, heads * cfg.v_head_dim)}
    if cfg.attention_bias:
        shapes |= {p + "kv_a_proj_with_mqa.bias": (rank + rope,), p + "o_proj.bias": (h,)}
        if cfg.q_lora_rank:
            shapes[p + "q_a_proj.bias"] = (cfg.q_lora_rank,)
    return shapes


def _linear_attention_shapes(cfg: ModelConfig, layer: str) -> dict[str, tuple[int, ...]]:
    """A gated DeltaNet layer's tensors (models/gated_deltanet.py), as Qwen3-Next's checkpoints name them."""
    h, keys, values = cfg.hidden_size, cfg.linear_num_key_heads * cfg.linear_key_head_dim, \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    heads, p = cfg.linear_num_value_heads, layer + "linear_attn."
    return {p + "in_proj_qkvz.weight": (2 * keys + 2 * values, h), p + "in_proj_ba.weight": (2 * heads, h),
            p + "conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel), p + "dt_bias": (heads,),
            p + "A_log": (heads,), p + "norm.weight": (cfg.linear_value_head_dim,), p + "out_proj.weight": (h, values)}


def _layer_norm_decoder_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GPT-2, OPT, Phi-2 under ember's names (checkpoint_names maps theirs): LayerNorms with
    biases, a bias on every projection, fc1 / fc2; learned positions, Phi-2's one norm a layer
    and its LM head's bias where the config says."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    if cfg.learned_positions:
        shapes["model.embed_positions.weight"] = (cfg.max_position_embeddings + cfg.position_offset, h)
    shapes |= {"model.norm.weight": (h,), "model.norm.bias": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.lm_head_bias:
        shapes["lm_head.bias"] = (cfg.vocab_size,)
    norms = ("input_layernorm",) if cfg.parallel_block else ("input_layernorm", "post_attention_layernorm")
    fused = FAMILIES[cfg.architecture].fused_projections
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm in norms:
            shapes |= {f"{p}{norm}.weight": (h,), f"{p}{norm}.bias": (h,)}
        parts = {"qkv_proj": q + 2 * kv} if fused else {"q_proj": q, "k_proj": kv, "v_proj": kv}
        for part, rows in parts.items():
            shapes |= {f"{p}self_attn.{part}.weight": (rows, h), f"{p}self_attn.{part}.bias": (rows,)}
        shapes |= {p + "self_attn.o_proj.weight": (h, q), p + "self_attn.o_proj.bias": (h,),
                   p + "mlp.fc1.weight": (inter, h), p + "mlp.fc1.bias": (inter,),
                   p + "mlp.fc2.weight": (h, inter), p + "mlp.fc2.bias": (h,)}
    return shapes


def _expert_shapes(cfg: ModelConfig, layer: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and per-expert tensors, as its HF checkpoint names them
    (gpt-oss's stacked ones under ember's names, in ember's layout)."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if cfg.moe_bias:
        e, p = cfg.num_experts, layer + "mlp."
        if cfg.mxfp4_experts:  # uint8: two values a byte, one scale a 32 (layers/quant/mxfp4.py)
            w13 = {p + "w13_blocks": (e, 2 * inter, h // 2), p + "w13_scales": (e, 2 * inter, h // 32)}
            w2 = {p + "w2_blocks": (e, h, inter // 2), p + "w2_scales": (e, h, inter // 32)}
        else:
            w13, w2 = {p + "w13": (e, 2 * inter, h)}, {p + "w2": (e, h, inter)}
        return {p + "gate.weight": (e, h), p + "gate.bias": (e,)} | w13 | {p + "w13_bias": (e, 2 * inter)} | w2 | \
            {p + "w2_bias": (e, h)}
    if cfg.moe_input_scaled:  # Llama 4: stacked experts and a shared one
        e, p = cfg.num_experts, layer + "mlp."
        return {p + "gate.weight": (e, h), p + "w13": (e, 2 * inter, h), p + "w2": (e, h, inter),
                p + "shared_expert.gate_proj.weight": (inter, h), p + "shared_expert.up_proj.weight": (inter, h),
                p + "shared_expert.down_proj.weight": (h, inter)}
    mixtral = FAMILIES[cfg.architecture].moe == "mixtral"
    p = layer + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (cfg.num_experts, h)}
    if cfg.moe_scoring == "sigmoid":  # DeepSeek-V3: the bias its router chooses by
        shapes[p + "gate.e_score_correction_bias"] = (cfg.num_experts,)
    if cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        shapes |= {p + "shared_expert.gate_proj.weight": (shared, h), p + "shared_expert.up_proj.weight": (shared, h),
                   p + "shared_expert.down_proj.weight": (h, shared)}
        if cfg.shared_expert_gate:
            shapes[p + "shared_expert_gate.weight"] = (1, h)
    for e in range(cfg.num_experts):
        shapes |= {f"{p}experts.{e}.{gate}.weight": (inter, h), f"{p}experts.{e}.{up}.weight": (inter, h),
                   f"{p}experts.{e}.{down}.weight": (h, inter)}
    return shapes


# a vision-language checkpoint's language model under either of transformers' spellings
# (Google's Gemma 3 files, and what transformers 5 writes: language_model.model.*; its module
# names since 4.52, in checkpoints saved so: model.language_model.*), and the parts of it
# ember does not load (text prompts only)
_LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                            "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("vision_tower.", "vision_model.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.", "visual.", "model.visual.")
_VISION_NAMES = ("image_newline", "model.image_newline")  # LLaVA-NeXT's


def checkpoint_names(cfg: ModelConfig) -> Callable[[str], str | None] | None:
    """For a checkpoint of this config whose tensor names are not a causal LM's: a map from
    its names to the causal LM's (None for a tensor not to read at all); None where the names
    are the causal LM's already. An encoder's: models/bert.py's, which are its base model's."""
    if cfg.bidirectional:
        return lambda name: _encoder_name(name, pooler=cfg.classifier == "bert")
    if FAMILIES[cfg.architecture].hf_tensor_names:
        rules = [(re.compile(pattern), ours) for pattern, ours in FAMILIES[cfg.architecture].hf_tensor_names]
        if FAMILIES[cfg.architecture].moe == "deepseek":  # multi-token-prediction layers follow the model's: not read
            return lambda name: None if _layer_index(name) >= cfg.num_layers else _renamed(name, rules)
        if cfg.multimodal:  # Llama 4's: the language model's names, then the family's
            return lambda name: None if (ours := _language_model_name(name)) is None else _renamed(ours, rules)
        return lambda name: _renamed(name, rules)
    return _language_model_name if cfg.multimodal else None


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _layer_index(name: str) -> int:
    """The decoder layer a tensor belongs to, -1 for none."""
    return int(m[1]) if (m := _LAYER.match(name)) else -1


def _renamed(name: str, rules: list[tuple[re.Pattern, str | None]]) -> str | None:
    """The first rule whose pattern begins the name renames that part of it (None: not read)."""
    for pattern, ours in rules:
        if (m := pattern.match(name)) is not None:
            return None if ours is None else m.expand(ours) + name[m.end():]
    return name


# GPT-2's Conv1D layers hold their weights [in, out]: ember's names for them
_CONV1D = re.compile(r"model\.layers\.\d+\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.fc1|mlp\.fc2)\.weight")


# the projections whose rows hold interleaved RoPE dims: DeepSeek's (the queries' per head, the
# latent's last), Llama 4's (q and k, whole heads)
_ROPE_ROWS = re.compile(r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|q_b_proj|kv_a_proj_with_mqa)\.(weight|bias)")
# stacked experts stored [E, in, out] (Llama 4's), turned to FusedMoE's [E, out, in]
_STACKED_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.(w13|w2)")


def tensor_changes(cfg: ModelConfig) -> str | None:
    """What checkpoint_tensors changes in this family's tensors as they load, or None."""
    family = FAMILIES[cfg.architecture]
    if family.conv1d_weights:
        return "its Conv1D weights turned to [out, in]"
    if family.moe in ("gpt_oss", "llama4"):
        return "its stacked experts transposed"
    if cfg.rope_interleaved:
        return "its interleaved RoPE rows reordered"
    if cfg.linear_layers is not None:
        return "its linear-attention projections' rows reordered"
    return None


def check_int_family(cfg: ModelConfig, method: str) -> None:
    """ValueError where the family's tensors change as they load (checkpoint_tensors), which
    packed integer weights do not go through."""
    if (what := tensor_changes(cfg)) is not None:
        raise ValueError(f"{method} checkpoints of {cfg.architecture} are not supported yet: ember changes its "
                         f"tensors at load ({what}), which it does not do to packed integer weights. Use an "
                         "unquantized or FP8 checkpoint of the model, or a GGUF file")


def checkpoint_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors (under ember's names) in the layout ember computes with: GPT-2's
    Conv1D weights turned to [out, in], as every other checkpoint and llama.cpp's GPT-2 GGUFs
    hold them; DeepSeek's and Llama 4's interleaved RoPE rows reordered to rotate-half
    (models/mla.py); Llama 4's stacked experts transposed."""
    if FAMILIES[cfg.architecture].conv1d_weights:
        return ((name, t.t() if _CONV1D.fullmatch(name) else t) for name, t in tensors)
    if FAMILIES[cfg.architecture].moe == "gpt_oss":
        return _gpt_oss_experts(tensors, keep_mxfp4=cfg.mxfp4_experts)
    if FAMILIES[cfg.architecture].moe == "llama4":
        tensors = ((name, t.transpose(1, 2) if _STACKED_EXPERTS.fullmatch(name) else t) for name, t in tensors)
    if cfg.rope_interleaved:
        return ((name, rope_rows_to_halves(cfg, m[1], t) if (m := _ROPE_ROWS.fullmatch(name)) else t)
                for name, t in tensors)
    if cfg.linear_layers is not None:
        return ((name, linear_rows_by_part(cfg, m[1], t) if (m := _LINEAR_IN_ROWS.fullmatch(name)) else t)
                for name, t in tensors)
    return tensors


_LINEAR_IN_ROWS = re.compile(r"model\.layers\.\d+\.linear_attn\.in_proj_(qkvz|ba)\.weight")


def linear_rows_by_part(cfg: ModelConfig, projection: str, t: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's linear-attention input projections hold their rows by key head: in_proj_qkvz
    [q | k | v | z] of each key head (v and z for its group of value heads), in_proj_ba [b | a]
    of each. Reordered part by part (every q row, then every k, v, z; every b, then a), so the
    convolution's q | k | v channels and each of the others are one slice of the output."""
    group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    sizes = [dk, dk, group * dv, group * dv] if projection == "qkvz" else [group, group]
    heads = t.reshape(cfg.linear_num_key_heads, sum(sizes), *t.shape[1:])
    return torch.cat([part.reshape(-1, *t.shape[1:]) for part in heads.split(sizes, dim=1)])


_MXFP4 = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales)")
_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.(w13|w13_bias|w2)")


def _gpt_oss_experts(tensors: Iterable[tuple[str, torch.Tensor]], keep_mxfp4: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts in FusedMoE's layout: transformers' dense gate_up_proj
    [E, H, 2I] (gate and up columns interleaved) -> w13 [E, 2I, H] (gate rows, then up), its
    bias alike, down_proj [E, I, H] -> w2 [E, H, I]; the released MXFP4 blocks and scales
    ([E, out, in / 32, 16] and [E, out, in / 32], rows interleaved as the dense columns) are
    decoded to the same (layers/quant/mxfp4.py), or with `keep_mxfp4` kept, their rows in
    the same order: w13_blocks [E, 2I, H / 2], w13_scales [E, 2I, H / 32], w2_blocks, w2_scales."""
    from ember.layers.quant.mxfp4 import check_mxfp4, dequantize_mxfp4

    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if (m := _MXFP4.fullmatch(name)) is not None:
            if (pair := completed_pair(pending, (m[1], m[2]), m[3], t)) is not None:
                ours = f"{m[1]}.mlp.{'w13' if m[2] == 'gate_up' else 'w2'}"
                rows = _gate_up_rows if m[2] == "gate_up" else torch.Tensor.contiguous
                if keep_mxfp4:
                    check_mxfp4(pair["blocks"], pair["scales"])
                    yield f"{ours}_blocks", rows(pair["blocks"]).flatten(-2)
                    yield f"{ours}_scales", rows(pair["scales"])
                else:
                    yield ours, rows(dequantize_mxfp4(pair["blocks"], pair["scales"]))
            continue
        if (m := _GPT_OSS_EXPERTS.fullmatch(name)) is not None:
            if m[1] == "w13":
                t = _gate_up_rows(t.transpose(1, 2))
            elif m[1] == "w13_bias":
                t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
            else:
                t = t.transpose(1, 2)
        yield name, t
    if pending:
        raise ValueError(f"MXFP4 expert tensors without their pair: {sorted(pending)}")


def completed_pair(pending: dict, key: object, part: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Two tensors a checkpoint stores apart that load as one (MXFP4 blocks and scales, a GGUF's
    k_b and v_b, its gate and up biases): holds `tensor` as `part` of `key`'s pair in `pending`
    until the other part is read, then hands the pair out (and forgets it)."""
    pair = pending.setdefault(key, {})
    pair[part] = tensor
    return pending.pop(key) if len(pair) == 2 else None


def _gate_up_rows(w: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] rows gate, up, gate, up, ... -> every gate row, then every up row."""
    return torch.cat([w[:, 0::2], w[:, 1::2]], dim=1).contiguous()


def rope_rows_to_halves(cfg: ModelConfig, projection: str, t: torch.Tensor) -> torch.Tensor:
    """(A checkpoint's or a GGUF file's rows: a tensor, or GGUF blocks' bytes a row.) The RoPE rows of a projection, interleaved pairs (x0 x1 | x2 x3 ...), as [evens | odds]:
    the queries' (and keys') last rotary_dim rows of each head, the latent projection's last rotary_dim."""
    rope = cfg.rotary_dim
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if projection == "kv_a_proj_with_mqa":
        return torch.cat([t[:-rope], t[-rope:][order]])
    heads = t.reshape(cfg.num_kv_heads if projection == "k_proj" else cfg.num_heads, cfg.head_dim, *t.shape[1:])
    return torch.cat([heads[:, :-rope], heads[:, -rope:][:, order]], dim=1).reshape(t.shape)


# what an encoder checkpoint holds that its embeddings and classification do not read: the
# position-id buffer of older files, a masked-LM head
_ENCODER_UNUSED = ("embeddings.position_ids", "cls.", "lm_head.")


def _encoder_name(name: str, pooler: bool) -> str | None:
    """A BERT / XLM-R tensor's name in models/bert.py: a *ForSequenceClassification's base
    model prefix dropped, old files' LayerNorm gamma / beta renamed; None for what is not
    read (the pooler of an embedding model: sentence-transformers pools hidden states)."""
    for prefix in ("bert.", "roberta."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith(_ENCODER_UNUSED) or (name.startswith("pooler.") and not pooler):
        return None
    if name.endswith(("LayerNorm.gamma", "LayerNorm.beta")):
        name = name[:-5] + "weight" if name.endswith("gamma") else name[:-4] + "bias"
    return name


def _language_model_name(name: str) -> str | None:
    if name.startswith(_VISION_PREFIXES) or name in _VISION_NAMES:
        return None
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name  # not the language model's: load_weights names it as unknown


def is_expert_weight(name: str) -> bool:
    """A checkpoint tensor that is one routed expert's projection (a shard of FusedMoE's w13 or w2)."""
    return _EXPERT.fullmatch(name) is not None


def _target(name: str) -> tuple[str, int | None]:
    """HF name -> (ember parameter name, shard index or None)."""
    if (m := _EXPERT.fullmatch(name)) is not None:
        param, half = _EXPERT_PARTS[m[3]]
        expert = int(m[2])
        return f"{m[1]}.mlp.{param}", expert if half is None else 2 * expert + half
    if (m := _MIXTRAL_ROUTER.fullmatch(name)) is not None:
        return f"{m[1]}.mlp.gate.weight", None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED:
            merged, shard = PACKED[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1:]), shard
    return name, None


def load_weights(model: nn.Module,
                 weights: Iterable[tuple[str, torch.Tensor | BlockTensor | FP8Tensor | IntTensor | W8A8Tensor]],
                 source: str) -> None:
    """Copy every checkpoint tensor into its parameter; each parameter (shard) exactly once.
    A BlockTensor (GGUF blocks kept quantized), an FP8Tensor (an FP8 checkpoint's weight
    with its scales), an IntTensor (an AWQ / GPTQ / compressed-tensors weight) or a W8A8Tensor
    (an int-quantized W8A8 weight with its scales) goes to the
    layer owning the parameter, which takes it as its weight format once all are in
    (`finish_loading`), or to the weight loader of a parameter that `loads_quantized`
    (FusedMoE's FP8 and integer experts, which hold their scales beside them); an FP8Tensor,
    IntTensor or W8A8Tensor for a parameter no such kernel takes (dense experts, as on the CPU;
    W8A8 experts; MLA's kv_b_proj; an LM head) loads dequantized, logged once.

    Raises ValueError naming unknown, duplicated and missing tensors."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected: set[tuple[str, int | None]] = set()
    for pname, param in params.items():
        if getattr(param, "loads_with_weight", False):  # FP8 and integer experts' scales: filled with their weights
            continue
        shards = _num_shards(model, pname)
        expected |= {(pname, s) for s in range(shards)} if shards else {(pname, None)}
    done: set[tuple[str, int | None]] = set()
    unknown: list[str] = []
    dequantized: list[str] = []
    kv_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if tied and name == "lm_head.weight":
            continue  # some tied checkpoints store a copy of the embedding
        if name not in params and (kv_scale := kv_scale_target(name)) is not None:  # an fp8 KV cache's
            if kv_scale in kv_scales:
                raise ValueError(f"{source}: two tensors give {kv_scale} (the second: {name!r})")
            kv_scales[kv_scale] = tensor
            continue
        if isinstance(tensor, torch.Tensor) and tensor.dtype in _FP8_DTYPES:
            raise ValueError(f"{source}: tensor {name!r} is {tensor.dtype} with no scale paired to it: an FP8 "
                             "checkpoint's config.json names its scheme in quantization_config (ember reads "
                             "quant_method 'fp8' and 'compressed-tensors')")
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int8:
            raise ValueError(f"{source}: tensor {name!r} is int8 with no scale paired to it: an int8 (W8A8) "
                             "checkpoint's config.json names its scheme in quantization_config (ember reads "
                             "compressed-tensors int-quantized)")
        pname, shard = _target(name)
        if pname not in params and name in params:  # a name PACKED merges that this model keeps apart (MLA's q_proj)
            pname, shard = name, None
        if pname not in params:
            unknown.append(name)
            continue
        if (pname, shard) in done:
            raise ValueError(f"{source}: tensor {name!r} appears twice")
        param = params[pname]
        owner = model.get_submodule(pname.rpartition(".")[0])
        kept = isinstance(tensor, (BlockTensor, FP8Tensor, IntTensor, W8A8Tensor)) \
            and not getattr(param, "loads_quantized", False)
        if kept and not isinstance(tensor, BlockTensor) and not hasattr(owner, _KEEPS[type(tensor)]):
            tensor = tensor.dequantize()
            kept = False
            dequantized.append(name)
        loader = getattr(param, "weight_loader", None)
        shards = _num_shards(model, pname)
        try:
            with torch.no_grad():
                if kept:
                    getattr(owner, _KEEPS[type(tensor)])(tensor, shard)
                elif loader is None:  # a plain parameter (replicated on every tensor-parallel rank)
                    if param.shape != tensor.shape:
                        raise ValueError(f"parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
                    param.data.copy_(tensor)
                else:  # the layer narrows it to this rank's part; shard None: a merged one stored
                    loader(param, tensor, shard)  # merged (Phi-3's qkv_proj, gate_up_proj)
        except ValueError as e:
            raise ValueError(f"{source}: tensor {name!r} does not fit {pname}: {e}") from None
        if shard is None and shards:
            if any((pname, s) in done for s in range(shards)):
                raise ValueError(f"{source}: tensor {name!r} overlaps its parts stored separately")
            done |= {(pname, s) for s in range(shards)}
            continue
        done.add((pname, shard))
    if dequantized:
        logger.info("%s: %d quantized weights dequantized to the run dtype at load (%s%s): no FP8 or integer-weight "
                    "kernel of ember's takes them here (experts: FP8 and integer ones on CUDA only, W8A8 ones "
                    "nowhere; latent projections and LM heads: none yet)", source, len(dequantized),
                    ", ".join(dequantized[:3]), " ..." if len(dequantized) > 3 else "")
    unknown += _load_kv_scales(model, kv_scales, source)
    missing = sorted(expected - done, key=str)
    if unknown or missing:
        msg = [f"{source} does not match the model ({type(model).__name__}):"]
        if unknown:
            msg.append(f"{len(unknown)} unknown tensor(s): {', '.join(unknown[:8])}")
        if missing:
            msg.append(f"{len(missing)} missing: {', '.join(_show(m) for m in missing[:8])}")
        raise ValueError(" ".join(msg))
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()


def _load_kv_scales(model: nn.Module, scales: dict[str, torch.Tensor], source: str) -> list[str]:
    """A checkpoint's KV-cache scales into its attention layers' k_scale / v_scale buffers:
    every layer's or none (ValueError), each one positive number; returns the names no
    attention layer has."""
    if not scales:
        return []
    buffers = dict(model.named_buffers())
    unknown = [name for name in scales if name not in buffers]
    wanted = {n for n in buffers if n.endswith((".k_scale", ".v_scale"))}
    if missing := sorted(wanted - set(scales)):
        raise ValueError(f"{source}: KV-cache scales for some attention layers only: no {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    for name in wanted:
        value = scales[name].float().reshape(-1)
        if value.numel() != 1 or not bool(value[0] > 0) or not bool(value.isfinite().all()):
            raise ValueError(f"{source}: KV-cache scale {name} must be one positive number (per-tensor), got "
                             f"{tuple(scales[name].shape)} {value[:4].tolist()}")
        buffers[name].copy_(value)
    logger.info("%s: the KV-cache scales of %d attention layers read (an fp8 cache, --kv-cache-dtype fp8, "
                "stores K / k_scale and V / v_scale; a cache in the model's dtype needs none)", source,
                len(wanted) // 2)
    return unknown


# the method of a layer that keeps each quantized kind as it is (Linear, the embedding, the LM head)
_KEEPS = {BlockTensor: "load_blocks", FP8Tensor: "load_fp8", IntTensor: "load_int", W8A8Tensor: "load_w8a8"}


def _num_shards(model: nn.Module, pname: str) -> int | None:
    """How many checkpoint tensors fill this merged parameter (the parameter says, or its
    module for all of its parameters); None for a plain one."""
    own = getattr(model.get_parameter(pname), "num_shards", None)
    return own if own is not None else getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "num_shards", None)


def hf_module_names(module: str) -> list[str]:
    """An ember module's name and the checkpoint modules merged into it: ...qkv_proj ->
    [...qkv_proj, ...q_proj, ...k_proj, ...v_proj]."""
    parent, _, last = module.rpartition(".")
    return [module] + [f"{parent}.{original}" if parent else original
                       for original, (merged, _) in PACKED.items() if merged == last]


def _show(item: tuple[str, int | None]) -> str:
    """A parameter (shard) under the name the checkpoint would give it."""
    name, shard = item
    if shard is None:
        return name
    parts = name.split(".")
    if parts[-1] in ("w13", "w2"):  # a stacked expert weight (layers/moe.py)
        expert, half = divmod(shard, 2) if parts[-1] == "w13" else (shard, 2)
        return ".".join(parts[:-1] + ["experts", str(expert), ("gate_proj", "up_proj", "down_proj")[half], "weight"])
    for original, (merged, index) in PACKED.items():
        if index == shard and merged in parts:
            parts[parts.index(merged)] = original
    return ".".join(parts)
