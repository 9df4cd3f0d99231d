"""FP8 checkpoints (an HF config.json's `quantization_config`), and FP8 made at load.

    fp8_scheme(qc)                  an fp8 quantization_config -> FP8Scheme (loader/
                                    quant_config.py picks the reader of each method)
    fp8_weights(weights, scheme)    the checkpoint's tensors with each fp8 `X.weight` paired
                                    with its `X.weight_scale` / `X.weight_scale_inv` into
                                    one FP8Tensor (or dequantized to a dense float32 tensor)
    quantize_linear_layers(model)   --quantization fp8 on dense weights (a bf16 checkpoint,
                                    dummy weights): every linear layer but the LM head and
                                    the embedding, per output row, skipping what the
                                    checkpoint's ignore-list names
    fp8_experts(cfg, scheme)        how the checkpoint's routed experts stay FP8 (on CUDA):
                                    "block" or "row" scales, or None (dense)

The two forms read (as vLLM does):

    quant_method "fp8"                 activation_scheme dynamic | static, weight_block_size
                                       [128, 128] (X.weight_scale_inv per block) or none
                                       (X.weight_scale per tensor), modules_to_not_convert /
                                       ignored_layers
    quant_method "compressed-tensors"  config_groups.*.weights: num_bits 8, type float,
                                       symmetric, strategy tensor | channel | block
                                       (block_structure [128, 128]); input_activations
                                       dynamic (per token), static (X.input_scale) or none;
                                       ignore

Static input scales are not used: ember quantizes activations per token, dynamically (one
log line says so). The numerics (what a scale's shape means, dequantizing) are
layers/quant/fp8.py's; this file knows the checkpoints' names and keys.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ember.layers.quant.fp8 import FP8, FP8Tensor
from ember.loader.kv_scales import check_kv_cache_scheme
from ember.models.config import ModelConfig

logger = logging.getLogger(__name__)

SUPPORTED = ("ember loads FP8 (e4m3) checkpoints: quant_method 'fp8' (scales per tensor or per 128 x 128 block) "
             "and 'compressed-tensors' with 8-bit float weights (strategy tensor, channel or block)")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # X.weight's dequantization multipliers
_FP8_KEYS = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "modules_to_not_convert",
             "ignored_layers"}
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
            "sparsity_config", "global_compression_ratio", "version", "transform_config", "moe_sparsity_config"}
_CT_FORMATS = ("float-quantized", "naive-quantized")  # fp8 values stored as they are
_CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "block_structure", "dynamic", "group_size",
                   "observer", "observer_kwargs", "actorder"}
_OTHER_FP8 = (torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclass(frozen=True)
class FP8Scheme:
    method: str  # fp8 | compressed-tensors
    block: tuple[int, int] | None  # the weights' scale blocks; None: per tensor or per output row
    static_activations: bool  # the checkpoint ships input scales (not used)
    ignore: tuple[str, ...] = ()  # modules left in the model dtype: names, or "re:<regex>"

    def ignores(self, module: str) -> bool:
        """The ignore-list names this module (HF name, e.g. model.layers.0.mlp.down_proj)."""
        return ignored(self.ignore, module)


def ignored(ignore: tuple[str, ...], module: str) -> bool:
    """A checkpoint's ignore-list (compressed-tensors' `ignore`, fp8's modules_to_not_convert)
    names this module (HF name, e.g. model.layers.0.mlp.down_proj): exactly, by its last parts
    (lm_head), by a parent (model.layers.0), or by a regex ("re:<regex>")."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry) or module.startswith(entry + "."):
            return True
    return False


def fp8_scheme(qc: dict[str, Any], source: str = "config.json") -> FP8Scheme:
    """The FP8 scheme of a quantization_config whose method is fp8 or compressed-tensors with
    fp8 values (loader/quant_config.py picks this reader)."""
    if qc.get("quant_method") == "fp8":
        return _fp8_method(qc, source)
    return _compressed_tensors(qc, source)


def _fp8_method(qc: dict[str, Any], source: str) -> FP8Scheme:
    note_unknown(qc, _FP8_KEYS, source)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: fp8 format {qc['fmt']!r} is not supported: ember takes e4m3 weights")
    activations = qc.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ValueError(f"{source}: activation_scheme {activations!r}: expected 'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    return FP8Scheme("fp8", _block(block, source), activations == "static", ignore)


def _compressed_tensors(qc: dict[str, Any], source: str) -> FP8Scheme:
    note_unknown(qc, _CT_KEYS, source)
    where = f"{source}: compressed-tensors"
    if qc.get("format") not in _CT_FORMATS:
        raise ValueError(f"{where} format {qc.get('format')!r} is not supported: ember reads {', '.join(_CT_FORMATS)} "
                         f"(fp8 values stored as they are), pack-quantized and int-quantized (int weights). {SUPPORTED}")
    for key in ("sparsity_config", "transform_config", "moe_sparsity_config"):
        if qc.get(key):
            raise ValueError(f"{where} with a {key} is not supported (it changes the weights' meaning): {SUPPORTED}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where} without config_groups: the file names no quantization scheme")
    blocks, static = set(), False
    for name, group in groups.items():
        weights = group.get("weights") or {}
        note_unknown(weights, _CT_WEIGHT_KEYS, f"{where} config_groups.{name}.weights")
        if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
            raise ValueError(f"{where} config_groups.{name}: weights of {weights.get('num_bits')} bits, type "
                             f"{weights.get('type')!r}, are not supported. {SUPPORTED}")
        if weights.get("symmetric") is False:
            raise ValueError(f"{where} config_groups.{name}: asymmetric fp8 weights (zero points) are not supported")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where} config_groups.{name}: weight strategy {strategy!r} is not supported "
                             "(tensor, channel or block)")
        if strategy == "block":
            blocks.add(_block(weights.get("block_structure"), f"{where} config_groups.{name} block_structure"))
        if group.get("output_activations"):
            raise ValueError(f"{where} config_groups.{name}: quantized output activations are not supported")
        act = group.get("input_activations")
        if act:
            if (act.get("num_bits"), act.get("type")) != (8, "float"):
                raise ValueError(f"{where} config_groups.{name}: input activations of {act.get('num_bits')} bits, "
                                 f"type {act.get('type')!r}, are not supported: ember quantizes them to fp8")
            static = static or not act.get("dynamic", False)
        else:
            logger.info("%s config_groups.%s: weight-only FP8; ember quantizes the activations per token on CUDA "
                        "for batches over the decode GEMV's rows", where, name)
    if len(blocks) > 1:
        raise ValueError(f"{where}: groups with different block structures {sorted(blocks)}")
    check_kv_cache_scheme(qc, where)
    ignore = qc.get("ignore") or ()
    return FP8Scheme("compressed-tensors", next(iter(blocks), None), static, tuple(ignore))


def _block(block: Any, source: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block)):
        raise ValueError(f"{source}: weight block size must be [rows, columns], got {block!r}")
    if tuple(block) != (128, 128):
        raise ValueError(f"{source}: fp8 weight blocks of {list(block)} are not supported: ember takes [128, 128]")
    return (128, 128)


def note_unknown(section: dict[str, Any], known: set[str], source: str) -> None:
    """A warning naming the keys of a quantization_config (section) that ember does not read."""
    unknown = sorted(set(section) - known)
    if unknown:
        logger.warning("%s: quantization keys ember does not read: %s", source, ", ".join(unknown))


def fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], scheme: FP8Scheme, dequantize: bool = False,
                source: str = "checkpoint") -> Iterator[tuple[str, torch.Tensor | FP8Tensor]]:
    """Each fp8 `X.weight` with its scale as one FP8Tensor under `X.weight` (or with
    `dequantize`, W * scale as float32), other tensors as they are. A weight and its scale
    may come in either order (or in different shards); one left without the other at the end
    is an error. Static input scales are skipped (logged once); KV-cache scales pass as
    they are (load_weights reads them)."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    skipped = {"input_scale": 0}

    def pair(module: str, weight: torch.Tensor, scale: torch.Tensor) -> tuple[str, torch.Tensor | FP8Tensor]:
        try:
            tensor = FP8Tensor.from_checkpoint(weight, scale, scheme.block)
        except ValueError as e:
            raise ValueError(f"{source}: {module}.weight: {e}") from None
        return module + ".weight", tensor.dequantize() if dequantize else tensor

    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            skipped["input_scale"] += 1
        elif leaf in ("weight_zero_point", "input_zero_point"):
            raise ValueError(f"{source}: {name}: asymmetric fp8 (zero points) is not supported")
        elif leaf in SCALE_NAMES:
            if module in scales_waiting:
                raise ValueError(f"{source}: {module} has two weight scales")
            if module in weights_waiting:
                yield pair(module, weights_waiting.pop(module), tensor)
            else:
                scales_waiting[module] = tensor
        elif leaf == "weight" and tensor.dtype == FP8:
            if module in scales_waiting:
                yield pair(module, tensor, scales_waiting.pop(module))
            else:
                weights_waiting[module] = tensor
        elif tensor.dtype in _OTHER_FP8:
            raise ValueError(f"{source}: {name} is {tensor.dtype}: ember takes float8_e4m3fn fp8 weights")
        else:
            yield name, tensor
    if weights_waiting or scales_waiting:
        names = [f"{m}.weight (no {' / '.join(SCALE_NAMES)})" for m in weights_waiting] + \
            [f"{m}.weight_scale (no fp8 {m}.weight)" for m in scales_waiting]
        raise ValueError(f"{source}: {len(names)} fp8 tensor(s) without their pair: {', '.join(names[:8])}")
    if skipped["input_scale"]:
        logger.warning("%s: %d static input_scale tensors not used: ember quantizes activations per token, "
                       "dynamically", source, skipped["input_scale"])


def fp8_experts(cfg: ModelConfig, scheme: FP8Scheme | None) -> Literal["block", "row"] | None:
    """How the routed experts of this FP8 checkpoint stay FP8 in FusedMoE: "block" (128 x 128
    scales) or "row" (per channel, or per tensor made per row); None where they load dense:
    no checkpoint scheme or no experts, experts stored stacked (gpt-oss, Llama 4: not read as
    FP8 here), or experts the ignore-list leaves unquantized."""
    if scheme is None or cfg.moe_layers is None or cfg.moe_bias or cfg.moe_input_scaled:
        return None
    from ember.loader.weights import hf_weight_shapes, is_expert_weight

    experts = [name.removesuffix(".weight") for name in hf_weight_shapes(cfg) if is_expert_weight(name)]
    if not experts or any(scheme.ignores(module) for module in experts):
        return None
    return "block" if scheme.block else "row"


def quantize_linear_layers(model: nn.Module, scheme: FP8Scheme | None = None) -> int:
    """Every linear layer of the model (not the LM head or the embedding) in FP8 with a scale
    per output row, but those the scheme's ignore-list names; returns how many."""
    from ember.layers.linear import Linear
    from ember.loader.weights import hf_module_names

    done = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if scheme is not None and any(scheme.ignores(n) for n in hf_module_names(name)):
            continue
        module.quantize_fp8()
        done += 1
    return done
