"""Checkpoint tensors (HF names) -> model parameters, ending with a completeness check.

Every source (GGUF, safetensors, dummy) yields HF-named tensors; this file alone knows
how those names land on ember's merged parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ember.layers.quant.fp8 import FP8Tensor
from ember.layers.quant.gguf_blocks import BlockTensor
from ember.models.config import ModelConfig
from ember.models.families import FAMILIES

# checkpoint projection -> (merged ember module, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# a mixture of experts' tensors (Mixtral's block_sparse_moe.*, Qwen3-MoE's mlp.*): the router
# -> mlp.gate, each expert's projections -> shards of the stacked mlp.w13 (gate 2e, up 2e + 1)
# and mlp.w2 (down e) of layers/moe.py
_EXPERT = re.compile(r"(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                 "w2": ("w2", None), "down_proj": ("w2", None)}
_MIXTRAL_ROUTER = re.compile(r"(.*)\.block_sparse_moe\.gate\.weight")

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, with its shape."""
    if cfg.bidirectional:
        from ember.models.bert import encoder_weight_shapes

        return encoder_weight_shapes(cfg)
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
            p + "self_attn.o_proj.weight": (h, q),
        }
        if dense:
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if fused:
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
            }
            if dense:
                shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h)}
        if not dense:
            shapes |= _expert_shapes(cfg, p)
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)}
    return shapes


def _expert_shapes(cfg: ModelConfig, layer: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and per-expert tensors, as its HF checkpoint names them."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    mixtral = FAMILIES[cfg.architecture].moe == "mixtral"
    p = layer + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (cfg.num_experts, h)}
    if cfg.shared_expert_intermediate_size:
        shared = cfg.shared_expert_intermediate_size
        shapes |= {p + "shared_expert.gate_proj.weight": (shared, h), p + "shared_expert.up_proj.weight": (shared, h),
                   p + "shared_expert.down_proj.weight": (h, shared), p + "shared_expert_gate.weight": (1, h)}
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
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def checkpoint_names(cfg: ModelConfig) -> Callable[[str], str | None] | None:
    """For a checkpoint of this config whose tensor names are not a causal LM's: a map from
    its names to the causal LM's (None for a tensor not to read at all); None where the names
    are the causal LM's already. An encoder's: models/bert.py's, which are its base model's."""
    if cfg.bidirectional:
        return lambda name: _encoder_name(name, pooler=cfg.classifier == "bert")
    return _language_model_name if cfg.multimodal else None


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
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name  # not the language model's: load_weights names it as unknown


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


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | BlockTensor | FP8Tensor]],
                 source: str) -> None:
    """Copy every checkpoint tensor into its parameter; each parameter (shard) exactly once.
    A BlockTensor (GGUF blocks kept quantized) or an FP8Tensor (an FP8 checkpoint's weight
    with its scales) goes to the layer owning the parameter, which takes it as its weight
    format once all are in (`finish_loading`).

    Raises ValueError naming unknown, duplicated and missing tensors."""
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    expected: set[tuple[str, int | None]] = set()
    for pname in params:
        shards = _num_shards(model, pname)
        expected |= {(pname, s) for s in range(shards)} if shards else {(pname, None)}
    done: set[tuple[str, int | None]] = set()
    unknown: list[str] = []
    for name, tensor in weights:
        if tied and name == "lm_head.weight":
            continue  # some tied checkpoints store a copy of the embedding
        if isinstance(tensor, torch.Tensor) and tensor.dtype in _FP8_DTYPES:
            raise ValueError(f"{source}: tensor {name!r} is {tensor.dtype} with no scale paired to it: an FP8 "
                             "checkpoint's config.json names its scheme in quantization_config (ember reads "
                             "quant_method 'fp8' and 'compressed-tensors')")
        pname, shard = _target(name)
        if pname not in params:
            unknown.append(name)
            continue
        if (pname, shard) in done:
            raise ValueError(f"{source}: tensor {name!r} appears twice")
        param = params[pname]
        loader = getattr(param, "weight_loader", None)
        shards = _num_shards(model, pname)
        try:
            with torch.no_grad():
                if isinstance(tensor, BlockTensor):
                    model.get_submodule(pname.rsplit(".", 1)[0]).load_blocks(tensor, shard)
                elif isinstance(tensor, FP8Tensor):
                    owner = model.get_submodule(pname.rsplit(".", 1)[0])
                    if not hasattr(owner, "load_fp8"):
                        raise ValueError(f"{type(owner).__name__} takes no FP8 weight: dequantize it in the checkpoint")
                    owner.load_fp8(tensor, shard)
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
