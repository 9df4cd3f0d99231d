"""Integer-weight checkpoints: W4A16 / W8A16 (AWQ, GPTQ, compressed-tensors pack-quantized and
weight-only int-quantized) and W8A8 (compressed-tensors int-quantized with int8 activations).

    int_scheme(qc, source)           config.json's quantization_config -> IntScheme, or a
                                     ValueError naming what ember does not read
    int_weights(tensors, scheme)     the checkpoint's tensors with each quantized module's
                                     parts as one IntTensor (a W8A8Tensor for W8A8) under
                                     `X.weight` (or, with `dequantize`, its float32 weight),
                                     the others as they are
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
                         or 8, strategy group (group_size) or channel, actorder (group:
                         X.weight_g_idx); no input activations (weight-only);
                         X.weight_packed, X.weight_scale, X.weight_shape, and where
                         symmetric is false X.weight_zero_point (W4A16_ASYM)
                         format "int-quantized" (llm-compressor's W8A8): weights type int,
                         num_bits 8, symmetric, strategy channel or tensor; input_activations
                         type int, num_bits 8, symmetric, strategy token with dynamic true (per
                         token, at run time) or strategy tensor with dynamic false (X.input_scale);
                         X.weight (int8), X.weight_scale. Without input_activations: W8A16,
                         strategy group too
                         (compressed-tensors omits zero points of symmetric schemes; where a file
                         has them they must be 0)

Modules a checkpoint leaves unquantized (its ignore-list, the LM head) hold a plain X.weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ember.layers.quant.awq import awq_tensor
from ember.layers.quant.compressed_tensors import int_quantized_tensor, pack_quantized_tensor
from ember.layers.quant.gptq import gptq_tensor
from ember.layers.quant.int_weight import IntTensor
from ember.layers.quant.w8a8 import W8A8Tensor
from ember.loader.fp8_checkpoint import ignored, note_unknown
from ember.loader.kv_scales import check_kv_cache_scheme

if TYPE_CHECKING:
    from ember.models.config import ModelConfig

logger = logging.getLogger(__name__)

INT_METHODS = ("awq", "gptq", "compressed-tensors")
CT_FORMATS = ("pack-quantized", "int-quantized")  # compressed-tensors' integer formats ember reads
# each method's (compressed-tensors: format's) module parts: those every quantized module has, and its g_idx
PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
         "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape"),
         "int-quantized": ("weight", "weight_scale")}
G_IDX = {"awq": None, "gptq": "g_idx", "compressed-tensors": "weight_g_idx", "int-quantized": None}

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
            "sparsity_config", "global_compression_ratio", "version", "transform_config", "moe_sparsity_config"}
_CT_WEIGHT_KEYS = {"num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                   "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}


@dataclass(frozen=True)
class IntScheme:
    method: str  # awq | gptq | compressed-tensors
    bits: int
    group_size: int  # columns a group; -1: one group a row
    act_order: bool  # the modules carry a g_idx (GPTQ's desc_act, compressed-tensors' actorder "group")
    symmetric: bool  # no zero points (the tensors say; this is what dummy weights are quantized to)
    zeros_minus_one: bool = False  # GPTQ's v1 format ("gptq") stores each zero point one less
    layout: str = "pack-quantized"  # compressed-tensors' format: pack-quantized or int-quantized
    activations: str | None = None  # W8A8: "dynamic" (per token) or "static" (X.input_scale); None: weight-only
    ignore: tuple[str, ...] = ()  # modules the checkpoint leaves in the model dtype (compressed-tensors' ignore)

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors every quantized module holds."""
        zeros = ("weight_zero_point",) if self._layout == "compressed-tensors" and not self.symmetric else ()
        return PARTS[self._layout] + zeros + (("input_scale",) if self.activations == "static" else ())

    @property
    def g_idx(self) -> str | None:
        """The name of a module's act-order tensor."""
        return G_IDX[self._layout]

    @property
    def _layout(self) -> str:
        return "int-quantized" if self.method == "compressed-tensors" and self.layout == "int-quantized" else self.method


def int_scheme(qc: dict[str, Any], source: str = "config.json") -> IntScheme:
    """The scheme of an awq, gptq or compressed-tensors (pack-quantized, int-quantized)
    quantization_config."""
    method = qc.get("quant_method")
    if method == "awq":
        return _awq(qc, source)
    if method == "gptq":
        return _gptq(qc, source)
    return _compressed_tensors(qc, source)


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


def _compressed_tensors(qc: dict[str, Any], source: str) -> IntScheme:
    note_unknown(qc, _CT_KEYS, source)
    layout = qc.get("format")
    where = f"{source}: compressed-tensors {layout}"
    if layout not in CT_FORMATS:
        raise ValueError(f"{source}: compressed-tensors format {layout!r} is not supported for integer weights: ember "
                         "reads pack-quantized (W4A16, W8A16) and int-quantized (W8A8, W8A16)")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"{where} with a {key} is not supported (it changes the weights' meaning)")
    if qc.get("moe_sparsity_config"):
        raise ValueError(f"{where} with a moe_sparsity_config (experts pruned or merged per layer) is not supported: "
                         "ember runs every layer's experts as config.json counts them")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where} without config_groups: the file names no quantization scheme")
    schemes = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        at = f"{where} config_groups.{name}"
        note_unknown(group, _CT_GROUP_KEYS, at)
        note_unknown(weights, _CT_WEIGHT_KEYS, f"{at}.weights")
        if group.get("format", layout) != layout:
            raise ValueError(f"{at}: format {group['format']!r} beside the config's {layout!r} (mixed formats) is "
                             "not supported")
        bits = weights.get("num_bits")
        if weights.get("type") != "int" or bits not in ((4, 8) if layout == "pack-quantized" else (8,)):
            raise ValueError(f"{at}: weights of {bits} bits, type {weights.get('type')!r}, are not supported: ember "
                             f"reads {'4- and 8-bit' if layout == 'pack-quantized' else '8-bit'} int weights in "
                             f"{layout}")
        symmetric = weights.get("symmetric") is not False
        if not symmetric and layout != "pack-quantized":
            raise ValueError(f"{at}: asymmetric weights (zero points) are not supported yet in {layout}: ember reads "
                             "zero points in pack-quantized weight-only checkpoints (W4A16_ASYM)")
        if weights.get("dynamic"):
            raise ValueError(f"{at}: dynamic weight quantization is not supported")
        if group.get("output_activations"):
            raise ValueError(f"{at}: quantized output activations are not supported")
        activations = _activations(group.get("input_activations"), bits, layout, at)
        strategy = weights.get("strategy")
        if activations:  # W8A8: a scale a row (the epilogue's)
            strategies = ("channel", "tensor")
        else:
            strategies = ("group", "channel", "tensor") if layout == "int-quantized" else ("group", "channel")
        if strategy not in strategies:
            scheme = "W8A8" if activations else layout
            raise ValueError(f"{at}: weight strategy {strategy!r} is not supported for {scheme}: ember reads "
                             f"{' or '.join(strategies)} weight scales there")
        actorder = weights.get("actorder")
        if actorder not in (None, False, True, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{at}: actorder {actorder!r} is not supported")
        act_order = actorder in (True, "group", "dynamic")  # dynamic: group's alias
        if act_order and layout == "int-quantized":
            raise ValueError(f"{at}: actorder {actorder!r} (a g_idx) is not supported in int-quantized checkpoints")
        size = _group_size(weights.get("group_size"), at) if strategy == "group" else -1
        if strategy == "group" and size == -1:
            raise ValueError(f"{at}: strategy group without a group_size")
        schemes.add((bits, size, act_order, activations, symmetric))
    if len(schemes) > 1:
        raise ValueError(f"{where}: config groups with different weight schemes {sorted(schemes, key=str)} are not "
                         "supported")
    check_kv_cache_scheme(qc, where)
    bits, size, act_order, activations, symmetric = schemes.pop()
    return IntScheme("compressed-tensors", bits, size, act_order, symmetric, layout=layout, activations=activations,
                     ignore=tuple(qc.get("ignore") or ()))


def _activations(act: dict[str, Any] | None, weight_bits: int, layout: str, at: str) -> str | None:
    """A config group's input_activations: None (weight-only), "dynamic" (int8 per token) or
    "static" (int8 with a per-tensor X.input_scale); anything else refused by name."""
    if not act:
        return None
    note_unknown(act, _CT_WEIGHT_KEYS, f"{at}.input_activations")
    if (act.get("type"), act.get("num_bits")) != ("int", 8):
        raise ValueError(f"{at}: input activations of {act.get('num_bits')} bits, type {act.get('type')!r}, are not "
                         "supported: ember quantizes activations to 8-bit ints (W8A8)")
    if weight_bits != 8 or layout != "int-quantized":
        raise ValueError(f"{at}: {weight_bits}-bit weights with int8 activations (W{weight_bits}A8, {layout}) are not "
                         "supported: ember runs W8A8 (int-quantized) and weight-only W4A16 / W8A16")
    if act.get("symmetric") is False:
        raise ValueError(f"{at}: asymmetric input activations (input zero points) are not supported: ember "
                         "quantizes activations symmetrically")
    strategy, dynamic = act.get("strategy"), act.get("dynamic")
    if strategy == "token" and dynamic is True:
        return "dynamic"
    if strategy == "tensor" and dynamic is False:
        return "static"
    raise ValueError(f"{at}: input activations of strategy {strategy!r}, dynamic {dynamic!r}, are not supported: "
                     "ember reads dynamic per-token (strategy 'token', dynamic true) and static per-tensor "
                     "(strategy 'tensor', dynamic false) int8 activations")


def int_weights(weights: Iterable[tuple[str, torch.Tensor]], scheme: IntScheme, dequantize: bool = False,
                source: str = "checkpoint") -> Iterator[tuple[str, torch.Tensor | IntTensor | W8A8Tensor]]:
    """Each quantized module's parts (IntScheme.parts, and its g_idx) as one IntTensor, or
    W8A8Tensor, `X.weight` (with `dequantize`, its float32 weight), yielded once they are all
    read; other tensors as they are (an int-quantized module's X.weight is a part where it is
    int8: an ignored module's float weight passes). A module left without a part at the end is
    an error, and so is a checkpoint with no quantized module at all; a GPTQ module without
    g_idx (an old checkpoint) is read at the end with groups in order, unless the scheme is
    act-order."""
    parts, g_idx = scheme.parts, scheme.g_idx
    wanted = parts + ((g_idx,) if g_idx is not None and (scheme.act_order or scheme.method == "gptq") else ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    built = 0

    def build(module: str, got: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor | IntTensor | W8A8Tensor]:
        nonlocal built
        try:
            tensor = _tensor(scheme, got)
        except ValueError as e:
            raise ValueError(f"{source}: {module}: {e}") from None
        built += 1
        return module + ".weight", tensor.dequantize() if dequantize else tensor

    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_zero_point", "input_zero_point") and leaf not in wanted:
            if bool(tensor.any()):
                raise ValueError(f"{source}: {name}: zero points in a symmetric scheme are not supported")
            continue  # some compressed-tensors versions write zeros for a symmetric scheme
        if leaf not in wanted or (leaf == "weight" and tensor.dtype != torch.int8):
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
    if scheme.activations:
        reason = "W8A8 (int8 activations): no fused MoE kernel quantizes the activations; the experts run dense"
    elif not fused_kernels:
        reason = ("on the CPU FusedMoE multiplies dense experts (GGUF experts are dequantized there too: no "
                  "block-kept expert path)")
    elif scheme.act_order:
        reason = "act-order groups (g_idx): the fused MoE kernels read each expert's groups in column order"
    else:
        # qzeros / weight_scale: held by a quantized module alone (an int-quantized one's weight is any module's)
        stored, part = set(tensor_names()), scheme.parts[1]
        plain = [m for m in experts if f"{m}.{part}" not in stored]
        if plain:
            reason = f"{len(plain)} of {len(experts)} expert projections are stored unquantized (e.g. {plain[0]})"
    if reason is not None:
        (logger.info if not fused_kernels else logger.warning)(
            "%s experts dequantized to the run dtype at load: %s", scheme.method, reason)
        return None
    return scheme.bits, scheme.group_size, scheme.symmetric


# dummy weights under a static W8A8 config: an input scale for inputs within +-16 (random
# weights' activations mean nothing; this keeps them in range)
DUMMY_INPUT_SCALE = 16 / 127


def quantize_int_layers(model: torch.nn.Module, scheme: IntScheme) -> int:
    """Every linear layer of the model (not the LM head or the embedding, nor what the scheme's
    ignore-list names) in the scheme's integers, rounded to nearest (dummy weights under an
    integer checkpoint's config); returns how many."""
    from ember.layers.linear import Linear
    from ember.loader.weights import hf_module_names

    done = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or any(ignored(scheme.ignore, n) for n in hf_module_names(name)):
            continue
        if scheme.activations:
            layer.quantize_w8a8(DUMMY_INPUT_SCALE if scheme.activations == "static" else None)
        else:
            layer.quantize_int(scheme.bits, scheme.group_size, scheme.symmetric)
        done += 1
    return done


def _tensor(scheme: IntScheme, got: dict[str, torch.Tensor]) -> IntTensor | W8A8Tensor:
    if scheme.activations:
        return W8A8Tensor.from_checkpoint(got["weight"], got["weight_scale"], got.get("input_scale"))
    if scheme.method == "compressed-tensors" and scheme.layout == "int-quantized":
        return int_quantized_tensor(got["weight"], got["weight_scale"],
                                    None if scheme.group_size == -1 else scheme.group_size)
    if scheme.method == "awq":
        return awq_tensor(got["qweight"], got["qzeros"], got["scales"], scheme.group_size)
    if scheme.method == "gptq":
        return gptq_tensor(got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"), scheme.bits,
                           scheme.group_size, scheme.zeros_minus_one)
    group = None if scheme.group_size == -1 else scheme.group_size
    return pack_quantized_tensor(got["weight_packed"], got["weight_scale"], got["weight_shape"],
                                 got.get("weight_g_idx"), scheme.bits, group, got.get("weight_zero_point"))
