"""compressed-tensors checkpoints written by the compressed-tensors library itself (the format
library llm-compressor saves with), and dequantized by it:

    FORMS                              the schemes the tests write: llm-compressor's presets
                                       (W4A16, W4A16_ASYM, W8A16, W8A8) and variants of them
    quantization_config(form)          config.json's quantization_config as the library writes
                                       it for one
    write_checkpoint(source, out, form, input_amax)
                                       the transformers-saved model in `source` quantized as
                                       llm-compressor does it: apply_quantization_config on
                                       its linear layers, each weight's scales (and zero
                                       points) from its min / max (what llm-compressor's
                                       minmax observer hands calculate_qparams; static input
                                       scales from the calibrated |input| likewise), then
                                       ModelCompressor.compress_model, the state dict saved
                                       and ModelCompressor.update_config writing config.json
    dequantize_checkpoint(path)        the library's own dequantizer (convert_checkpoint with
                                       CompressedTensorsDequantizer) to a plain float32
                                       checkpoint: the reference's weights

The linear layers are nn.Linear modules built from the saved tensors' names (one a projection,
a mixture's experts one each, as llm-compressor unfuses them to calibrate): transformers 5
holds a mixture's experts stacked in one tensor, which the library does not quantize.
A float32 model gives float32 scales, so the library's dequantized weights are exact.

What the library (0.20.1) cannot write, tests/int_checkpoints.py's packer still does:
act-order groups (actorder "group", a weight_g_idx), which the library has removed but older
llm-compressor checkpoints hold.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer, convert_checkpoint
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils import calculate_qparams
from loguru import logger
from safetensors.torch import load_file, save_file

logger.disable("compressed_tensors")  # its progress and debug lines

# the projections quantized: Llama's and Qwen3-MoE's experts' (Mixtral's w1, w3, w2)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")


def _scheme(preset: str, **weights) -> QuantizationScheme:
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weights:
        scheme.weights = QuantizationArgs(**(scheme.weights.model_dump() | weights))
    return scheme


def _static_w8a8(weights: str) -> QuantizationScheme:
    """W8A8 with calibrated per-tensor input scales, a weight scale a row (channel) or a tensor."""
    return QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy=weights, symmetric=True),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False))


# name -> (scheme, ignore-list)
FORMS = {
    "w4a16-g128": (lambda: _scheme("W4A16"), ("lm_head",)),
    "w4a16-g32": (lambda: _scheme("W4A16", group_size=32), ("lm_head",)),
    "w4a16-asym-g128": (lambda: _scheme("W4A16_ASYM"), ("lm_head",)),
    "w8a16-g128": (lambda: _scheme("W8A16"), ("lm_head",)),
    "w8a16-channel": (lambda: _scheme("W8A16", strategy="channel", group_size=None), ("lm_head",)),
    "w8a8-dynamic": (lambda: _scheme("W8A8"), ("lm_head",)),
    "w8a8-static": (lambda: _static_w8a8("channel"), ("lm_head",)),
    "w8a8-static-tensor": (lambda: _static_w8a8("tensor"), ("lm_head", "model.layers.0.mlp.down_proj")),
}


def quantization_config(form: str) -> dict:
    """What ModelCompressor.update_config writes into config.json for FORMS[form] (the format
    the library infers for a linear layer under the scheme)."""
    make, ignore = FORMS[form]
    scheme = make()
    scheme.format = infer_module_format(torch.nn.Linear, scheme)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore), format=scheme.format,
                                quantization_status=QuantizationStatus.COMPRESSED)
    with tempfile.TemporaryDirectory() as out:
        ModelCompressor(quantization_config=config).update_config(out)
        return json.loads((Path(out) / "config.json").read_text())["quantization_config"]


def _module_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree holding the tensors under their names: each projection's (and the LM head's)
    weight in an nn.Linear, the rest as plain parameters."""
    root = torch.nn.Module()
    linear = {n.rpartition(".")[0] for n, t in tensors.items()
              if n.endswith(".weight") and t.dim() == 2 and n.rpartition(".")[0].endswith(LINEAR + ("lm_head",))}
    for name, tensor in tensors.items():
        path, _, leaf = name.rpartition(".")
        module = root
        prefix = []
        for part in path.split("."):
            prefix.append(part)
            if not hasattr(module, part):
                here = ".".join(prefix)
                module.add_module(part, torch.nn.Linear(1, 1, bias=False) if here in linear else torch.nn.Module())
            module = getattr(module, part)
        setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def _observe_weight(module: torch.nn.Linear, args: QuantizationArgs) -> None:
    """The weight's scales (and zero points) from its min / max per row, group or tensor."""
    w = module.weight.detach()
    if args.strategy == "group":
        w = w.unflatten(-1, (-1, args.group_size))
        low, high = w.amin(-1), w.amax(-1)
    elif args.strategy == "channel":
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(low, high, args)
    update_offload_parameter(module, "weight_scale", scale)
    if hasattr(module, "weight_zero_point"):
        update_offload_parameter(module, "weight_zero_point", zero)


def write_checkpoint(source: Path, out: Path, form: str, input_amax: dict[str, float] | None = None) -> Path:
    """The model in `source` (config.json + model.safetensors saved by transformers) quantized as
    FORMS[form] says by the compressed-tensors library, in `out`; static input scales need each
    module's largest |input| (input_amax, tests/w8a8_checkpoints.py's calibrate). Returns `out`."""
    make, ignore = FORMS[form]
    scheme = make()
    tree = _module_tree(load_file(str(source / "model.safetensors")))
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                                quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(tree, config, show_progress=False)
    for name, module in tree.named_modules():
        quantized = getattr(module, "quantization_scheme", None)
        if quantized is None:
            continue
        _observe_weight(module, quantized.weights)
        if quantized.input_activations is not None and not quantized.input_activations.dynamic:
            amax = torch.tensor([input_amax[name]])
            scale, _ = calculate_qparams(-amax, amax, quantized.input_activations)
            update_offload_parameter(module, "input_scale", scale)
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tree.state_dict().items()}, str(out / "model.safetensors"))
    shutil.copy(source / "config.json", out / "config.json")
    compressor.update_config(str(out))
    return out


def dequantize_checkpoint(path: Path) -> Path:
    """The checkpoint in `path` dequantized to float32 by the library's own dequantizer, in
    `path`-dequantized (config.json without its quantization_config). Returns that."""
    out = path.parent / f"{path.name}-dequantized"
    convert_checkpoint(str(path), str(out), CompressedTensorsDequantizer(str(path), dtype=torch.float32),
                       max_workers=1, device="cpu")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config, "the library's dequantizer leaves no quantization_config"
    return out
