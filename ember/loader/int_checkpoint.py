"""Integer-weight checkpoints (W4A16, W8A16): AWQ, GPTQ and compressed-tensors pack-quantized.

    int_scheme(qc, source)           config.json's quantization_config -> IntScheme, or a
                                     ValueError naming what ember does not read
    int_weights(tensors, scheme)     the checkpoint's tensors with each quantized module's
                                     parts as one IntTensor under `X.weight` (or, with
                                     `dequantize`, its float32 weight), the others as they are
    int_experts(cfg, scheme, ...)    how the checkpoint's routed experts stay packed in
                                     FusedMoE where the fused MoE kernels run, or None

What each method's quantization_config says and its modules hold (the numerics are the
format files' in layers/quant/: awq.py, gptq.py, compressed_tensors.py):

    awq                  bits 4, group_size (-1: one group a row), zero_point true, version
                         "gemm"; X.qweight, X.qzeros, X.scales
    gptq                 bits 4 or 8, group_size, desc_act (act-order: X.g_idx), sym,
                         checkpoint_format "gptq" (zero points stored one less) or "gptq_v2";
                         X.qweight, X.qzeros, X.scales, X.g_idx
    compressed-tensors   format "pack-quantized", config_groups.*.weights: type int, num_bits 4
                         or 8, symmetric, strategy group (group_size) or channel, actorder
                         (group: X.weight_g_idx); no input activations (weight-only);
                         X.weight_packed, X.weight_scale, X.weight_shape

Modules a checkpoint leaves unquantized (its ignore-list, the LM head) hold a plain X.weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ember.layers.quant.awq import awq_tensor
from ember.layers.quant.compressed_tensors import pack_quantized_tensor
from ember.layers.quant.gptq import gptq_tensor
from ember.layers.quant.int_weight import IntTensor
from ember.loader.fp8_checkpoint import note_unknown

if TYPE_CHECKING:
    from ember.models.config import ModelConfig

logger = logging.getLogger(__name__)

INT_METHODS = ("awq", "gptq", "compressed-tensors")
# each method's module parts: those every quantized module has, and those read where present
PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
         "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape")}
G_IDX = {"awq": None, "gptq": "g_idx", "compressed-tensors": "weight_g_idx"}

_AWQ_KEYS = {"quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version",
             "modules_to_not_convert", "backend", "do_fuse", "fuse_max_seq_len"}
_GPTQ_KEYS = {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format", "format", "static_groups",
              "true_sequential", "damp_percent", "damp_auto_increment", "is_marlin_format", "model_name_or_path",
              "model_file_base_name", "pack_dtype", "dynamic", "lm_head", "meta", "quantizer", "tokenizer", "dataset",
              "use_cuda_fp16", "model_seqlen", "block_name_to_quantize", "module_name_preceding_first_block",
              "batch_size", "pad_token_id", "use_exllama", "max_input_length", "exllama_config",
              "cache_block_outputs", "modules_in_block_to_quantize", "backend", "mse", "v2", "v2_alpha",
              "act_group_aware", "hyb_act", "rotation", "adapter", "device"}
_CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
            "sparsity_config", "global_compression_ratio", "version", "transform_config"}
_CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                   "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}


@dataclass(frozen=True)
class IntScheme:
    method: str  # awq | gptq | compressed-tensors
    bits: int
    group_size: int  # columns a group; -1: one group a row
    act_order: bool  # the modules carry a g_idx (GPTQ's desc_act, compressed-tensors' actorder "group")
    symmetric: bool  # no zero points (the tensors say; this is what dummy weights are quantized to)
    zeros_minus_one: bool = False  # GPTQ's v1 format ("gptq") stores each zero point one less


def int_scheme(qc: dict[str, Any], source: str = "config.json") -> IntScheme:
    """The scheme of an awq, gptq or compressed-tensors pack-quantized quantization_config."""
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc, source)
    if method == "gptq":
        return _gptq(qc, source)
    return _pack_quantized(qc, source)


def _group_size(value: Any, where: str) -> int:
    if value is None:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or (value <= 0 and value != -1):
        raise ValueError(f"{where}: group_size must be a positive number of columns or -1 (one group a row); "
                         f"got {value!r}")
    return value


def _awq(qc: dict[str, Any], source: str) -> IntScheme:
    note_unknown(qc, _AWQ_KEYS, source)
    where = f"{source}: AWQ"
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where} of {bits} bits is not supported: ember reads 4-bit AWQ")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where} version {qc.get('version')!r} is not supported: ember reads AutoAWQ's GEMM "
                         "packing (version 'gemm'), not the GEMV, GEMV-fast or Marlin layouts")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{where} without zero points (zero_point {qc.get('zero_point')!r}) is not supported")
    if qc.get("backend", "autoawq") != "autoawq":
        raise ValueError(f"{where} backend {qc.get('backend')!r} (its own packing) is not supported: ember reads "
                         "AutoAWQ's ('autoawq')")
    return IntScheme("awq", 4, _group_size(qc.get("group_size", qc.get("q_group_size")), where), False, False)


def _gptq(qc: dict[str, Any], source: str) -> IntScheme:
    note_unknown(qc, _GPTQ_KEYS, source)
    where = f"{source}: GPTQ"
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"{where} of {bits} bits is not supported: ember reads 4- and 8-bit GPTQ")
    layout = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if qc.get("is_marlin_format"):
        layout = "marlin"
    if layout not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where} checkpoint_format {layout!r} is not supported: ember reads the 'gptq' (v1) and "
                         "'gptq_v2' layouts, not repacked kernel layouts (marlin, bitblas, ...)")
    if qc.get("pack_dtype", "int32") != "int32":
        raise ValueError(f"{where} pack_dtype {qc.get('pack_dtype')!r} is not supported: ember reads int32 words")
    if qc.get("dynamic"):
        raise ValueError(f"{where} with per-module `dynamic` overrides is not supported (modules of other bits or "
                         "groups)")
    return IntScheme("gptq", bits, _group_size(qc.get("group_size"), where), bool(qc.get("desc_act")),
                     qc.get("sym", True) is not False, zeros_minus_one=layout == "gptq")


def _pack_quantized(qc: dict[str, Any], source: str) -> IntScheme:
    note_unknown(qc, _CT_KEYS, source)
    where = f"{source}: compressed-tensors pack-quantized"
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"{where} with a {key} is not supported (it changes the weights' meaning)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where} without config_groups: the file names no quantization scheme")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        at = f"{where} config_groups.{name}"
        note_unknown(weights, _CT_WEIGHT_KEYS, f"{at}.weights")
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            raise ValueError(f"{at}: weights of {weights.get('num_bits')} bits, type {weights.get('type')!r}, are "
                             "not supported: ember reads 4- and 8-bit int weights")
        if weights.get("symmetric") is False:
            raise ValueError(f"{at}: asymmetric weights (zero points) are not supported yet: ember reads symmetric "
                             "pack-quantized weights")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{at}: weight strategy {strategy!r} is not supported (group or channel)")
        if weights.get("dynamic"):
            raise ValueError(f"{at}: dynamic weight quantization is not supported")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{at}: quantized activations (W4A8, W8A8) are not supported yet: ember reads "
                             "weight-only pack-quantized schemes (input_activations null)")
        actorder = weights.get("actorder")
        if actorder not in (None, False, True, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{at}: actorder {actorder!r} is not supported")
        size = _group_size(weights.get("group_size"), at) if strategy == "group" else -1
        if strategy == "group" and size == -1:
            raise ValueError(f"{at}: strategy group without a group_size")
        schemes.add((weights["num_bits"], size, actorder in (True, "group", "dynamic")))  # dynamic: group's alias
    if len(schemes) > 1:
        raise ValueError(f"{where}: config groups with different weight schemes {sorted(schemes)} are not supported")
    if qc.get("kv_cache_scheme"):
        logger.warning("%s: kv_cache_scheme is not read: the KV cache takes --kv-cache-dtype with scale 1.0", where)
    bits, size, act_order = schemes.pop()
    return IntScheme("compressed-tensors", bits, size, act_order, True)


def int_weights(weights: Iterable[tuple[str, torch.Tensor]], scheme: IntScheme, dequantize: bool = False,
                source: str = "checkpoint") -> Iterator[tuple[str, torch.Tensor | IntTensor]]:
    """Each quantized module's parts (PARTS, and its g_idx) as one IntTensor `X.weight` (with
    `dequantize`, its float32 weight), yielded once they are all read; other tensors as they
    are. A module left without a part at the end is an error, and so is a checkpoint with no
    quantized module at all; a GPTQ module without g_idx (an old checkpoint) is read at the
    end with groups in order, unless the scheme is act-order."""
    parts, g_idx = PARTS[scheme.method], G_IDX[scheme.method]
    wanted = parts + ((g_idx,) if g_idx is not None and (scheme.act_order or scheme.method == "gptq") else ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    built = 0

    def build(module: str, got: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor | IntTensor]:
        nonlocal built
        try:
            tensor = _tensor(scheme, got)
        except ValueError as e:
            raise ValueError(f"{source}: {module}: {e}") from None
        built += 1
        return module + ".weight", tensor.dequantize() if dequantize else tensor

    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_zero_point":
            if bool(tensor.any()):
                raise ValueError(f"{source}: {name}: zero points in a symmetric scheme are not supported")
            continue  # some compressed-tensors versions write zeros for a symmetric scheme
        if leaf not in wanted:
            yield name, tensor
            continue
        got = pending.setdefault(module, {})
        if leaf in got:
            raise ValueError(f"{source}: {name} appears twice")
        got[leaf] = tensor
        if len(got) == len(wanted):
            yield build(module, pending.pop(module))
    missing = {m: [p for p in wanted if p not in got] for m, got in pending.items()}
    late = [m for m, lack in missing.items() if lack == [g_idx] and not scheme.act_order]
    for module in late:
        yield build(module, pending.pop(module))
        del missing[module]
    if missing:
        names = [f"{m} (no {', '.join(lack)})" for m, lack in missing.items()]
        raise ValueError(f"{source}: {len(names)} quantized module(s) without all their parts: {', '.join(names[:8])}")
    if not built:
        raise ValueError(f"{source}: its quantization_config names {scheme.method}, but no module holds {scheme.method}'s "
                         f"tensors ({', '.join(parts)}): the config does not describe this checkpoint")


def int_experts(cfg: ModelConfig, scheme: IntScheme, tensor_names: Callable[[], Iterable[str]],
                fused_kernels: bool) -> tuple[int, int, bool] | None:
    """How the routed experts of this checkpoint stay packed in FusedMoE: (bits, group_size,
    symmetric), where the fused MoE kernels run (`fused_kernels`: CUDA) and every expert's
    projections are stored quantized (the checkpoint's `tensor_names` say). None where they load
    dequantized, logged with the reason: on the CPU (FusedMoE's torch path multiplies dense
    experts there, GGUF ones too: no block-kept expert path), act-order groups (GPTQ's
    desc_act, compressed-tensors' actorder: the kernels read groups in column order), experts
    the checkpoint leaves unquantized; no experts, or experts stored stacked (families
    check_int_family refuses)."""
    if cfg.moe_layers is None or cfg.moe_bias or cfg.moe_input_scaled:
        return None
    from ember.loader.weights import hf_weight_shapes, is_expert_weight

    experts = [name.removesuffix(".weight") for name in hf_weight_shapes(cfg) if is_expert_weight(name)]
    if not experts:
        return None
    reason = None
    if not fused_kernels:
        reason = ("on the CPU FusedMoE multiplies dense experts (GGUF experts are dequantized there too: no "
                  "block-kept expert path)")
    elif scheme.act_order:
        reason = "act-order groups (g_idx): the fused MoE kernels read each expert's groups in column order"
    else:
        stored, part = set(tensor_names()), PARTS[scheme.method][0]
        plain = [m for m in experts if f"{m}.{part}" not in stored]
        if plain:
            reason = f"{len(plain)} of {len(experts)} expert projections are stored unquantized (e.g. {plain[0]})"
    if reason is not None:
        (logger.info if not fused_kernels else logger.warning)(
            "%s experts dequantized to the run dtype at load: %s", scheme.method, reason)
        return None
    return scheme.bits, scheme.group_size, scheme.symmetric


def quantize_int_layers(model: torch.nn.Module, scheme: IntScheme) -> int:
    """Every linear layer of the model (not the LM head or the embedding) in the scheme's
    integers, rounded to nearest (dummy weights under an integer checkpoint's config); returns how many."""
    from ember.layers.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.quantize_int(scheme.bits, scheme.group_size, scheme.symmetric)
    return len(layers)


def _tensor(scheme: IntScheme, got: dict[str, torch.Tensor]) -> IntTensor:
    if scheme.method == "awq":
        return awq_tensor(got["qweight"], got["qzeros"], got["scales"], scheme.group_size)
    if scheme.method == "gptq":
        return gptq_tensor(got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"), scheme.bits,
                           scheme.group_size, scheme.zeros_minus_one)
    group = None if scheme.group_size == -1 else scheme.group_size
    return pack_quantized_tensor(got["weight_packed"], got["weight_scale"], got["weight_shape"],
                                 got.get("weight_g_idx"), scheme.bits, group)
