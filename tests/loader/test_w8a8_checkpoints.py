"""compressed-tensors `int-quantized` checkpoints (loader/int_checkpoint.py): llm-compressor's W8A8
config (tests/w8a8_checkpoints.py writes it as compressed-tensors serializes it) read as its
scheme with no flag, every variant ember does not run refused with a ValueError naming it, each
module's int8 weight paired with its scales into one W8A8Tensor (an IntTensor where the
activations stay float), and dummy weights under the config quantized so. The models run
against a reference in tests/models/test_w8a8_models.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from int_checkpoints import SIZES
from safetensors.torch import save_file
from w8a8_checkpoints import quantization_config, quantize_weight

from ember.layers.quant.int_weight import IntTensor
from ember.layers.quant.w8a8 import W8A8Tensor, W8A8Weight
from ember.loader.int_checkpoint import DUMMY_INPUT_SCALE, IntScheme, int_weights
from ember.loader.quant_config import checkpoint_scheme

DYNAMIC = quantization_config()
STATIC = quantization_config(static=True, weights="tensor", ignore=("lm_head", "re:.*layers\\.0\\.mlp\\.down_proj$"))


def _scheme(qc: dict) -> IntScheme:
    return checkpoint_scheme({"quantization_config": qc})


def _group(qc: dict, **change) -> dict:
    """qc with config_groups.group_0 changed: a section name maps to the keys to change in it."""
    group = dict(qc["config_groups"]["group_0"])
    for key, value in change.items():
        group[key] = group[key] | value if isinstance(value, dict) and group.get(key) else value
    return qc | {"config_groups": {"group_0": group}}


def test_llm_compressors_w8a8_configs_read_as_their_schemes():
    assert _scheme(DYNAMIC) == IntScheme("compressed-tensors", 8, -1, False, True, layout="int-quantized",
                                         activations="dynamic", ignore=("lm_head",))
    static = _scheme(STATIC)
    assert (static.activations, static.parts) == ("static", ("weight", "weight_scale", "input_scale"))
    weight_only = _scheme(_group(DYNAMIC, input_activations=None, weights={"strategy": "group", "group_size": 64}))
    assert (weight_only.activations, weight_only.group_size, weight_only.parts) == (None, 64, ("weight", "weight_scale"))


@pytest.mark.parametrize("change, error", [
    (dict(input_activations={"symmetric": False}), r"asymmetric input activations \(input zero points\) are not "
                                                   "supported: ember quantizes activations symmetrically"),
    (dict(input_activations={"strategy": "group", "group_size": 128}), "input activations of strategy 'group', "
                                                                       "dynamic True, are not supported"),
    (dict(input_activations={"strategy": "tensor"}), "input activations of strategy 'tensor', dynamic True"),
    (dict(input_activations={"type": "float"}), "input activations of 8 bits, type 'float', are not supported"),
    (dict(input_activations={"num_bits": 4}), "input activations of 4 bits, type 'int'"),
    (dict(weights={"num_bits": 4}), "weights of 4 bits, type 'int', are not supported: ember reads 8-bit int weights "
                                    "in int-quantized"),
    (dict(weights={"strategy": "group", "group_size": 128}), "weight strategy 'group' is not supported for W8A8: "
                                                             "ember reads channel or tensor weight scales there"),
    (dict(weights={"strategy": "block", "block_structure": [128, 128]}), "weight strategy 'block' is not supported"),
    (dict(weights={"symmetric": False}), r"asymmetric weights \(zero points\) are not supported yet"),
    (dict(output_activations={"num_bits": 8, "type": "int", "strategy": "tensor"}),
     "quantized output activations are not supported"),
    (dict(format="pack-quantized"), "format 'pack-quantized' beside the config's 'int-quantized'"),
    (dict(input_activations=None, weights={"strategy": "group", "group_size": 128, "actorder": "group"}),
     r"actorder 'group' \(a g_idx\) is not supported in int-quantized checkpoints"),
])
def test_what_ember_does_not_run_is_refused_by_name(change, error):
    with pytest.raises(ValueError, match=error):
        _scheme(_group(DYNAMIC, **change))


def test_w4a8_and_mixed_schemes_are_refused_by_name():
    pack = DYNAMIC | {"format": "pack-quantized"}
    with pytest.raises(ValueError, match=r"8-bit weights with int8 activations \(W8A8, pack-quantized\) are not "
                                         "supported: ember runs W8A8 \\(int-quantized\\)"):
        _scheme(_group(pack, format="pack-quantized"))
    w4a8 = _group(pack, format="pack-quantized", weights={"num_bits": 4, "strategy": "group", "group_size": 128})
    with pytest.raises(ValueError, match=r"4-bit weights with int8 activations \(W4A8, pack-quantized\)"):
        _scheme(w4a8)
    mixed = DYNAMIC | {"config_groups": {"group_0": DYNAMIC["config_groups"]["group_0"],
                                         "group_1": STATIC["config_groups"]["group_0"]}}
    with pytest.raises(ValueError, match="config groups with different weight schemes"):
        _scheme(mixed)
    with pytest.raises(ValueError, match="compressed-tensors format 'marlin-24' is not supported"):
        _scheme(DYNAMIC | {"format": "marlin-24"})


# -- pairing each module's tensors ---------------------------------------------------------------------------------


def _module(name: str, n: int = 32, k: int = 64, seed: int = 0, strategy: str = "channel") -> dict[str, torch.Tensor]:
    q, scale = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), strategy)
    return {f"{name}.weight": q, f"{name}.weight_scale": scale}


def test_parts_pair_in_any_order_and_float_weights_pass_through():
    a, b = _module("a", seed=1), _module("b", seed=2)
    tensors = [("b.weight_scale", b["b.weight_scale"]), ("a.weight", a["a.weight"]), ("norm.weight", torch.ones(4)),
               ("lm_head.weight", torch.ones(8, 64)), ("b.weight", b["b.weight"]),
               ("a.weight_zero_point", torch.zeros(32, 1, dtype=torch.int8)), ("a.weight_scale", a["a.weight_scale"])]
    out = list(int_weights(tensors, _scheme(DYNAMIC)))
    assert [n for n, _ in out] == ["norm.weight", "lm_head.weight", "b.weight", "a.weight"]
    got = dict(out)
    assert isinstance(got["a.weight"], W8A8Tensor) and torch.equal(got["a.weight"].weight, a["a.weight"])
    assert got["a.weight"].input_scale is None
    dense = dict(int_weights(tensors, _scheme(DYNAMIC), dequantize=True))
    assert torch.equal(dense["a.weight"], a["a.weight"].float() * a["a.weight_scale"].float())


def test_a_static_module_takes_its_input_scale_and_misses_none():
    a = _module("a", strategy="tensor") | {"a.input_scale": torch.tensor([0.5], dtype=torch.bfloat16)}
    (name, t), = int_weights(a.items(), _scheme(STATIC))
    assert name == "a.weight" and t.input_scale.tolist() == [0.5] and torch.equal(t.scale, a["a.weight_scale"].float(
        ).expand(32))
    without = [(n, v) for n, v in a.items() if n != "a.input_scale"]
    with pytest.raises(ValueError, match=r"1 quantized module\(s\) without all their parts: a \(no input_scale\)"):
        list(int_weights(without, _scheme(STATIC)))
    with pytest.raises(ValueError, match=r"a.input_zero_point: zero points in a symmetric scheme"):
        list(int_weights([("a.input_zero_point", torch.ones(1, dtype=torch.int8))] + list(a.items()), _scheme(STATIC)))


def test_a_weight_without_its_scale_and_a_config_that_does_not_describe_the_file_are_refused():
    with pytest.raises(ValueError, match=r"a \(no weight_scale\)"):
        list(int_weights([("a.weight", torch.zeros(4, 4, dtype=torch.int8))], _scheme(DYNAMIC)))
    with pytest.raises(ValueError, match=r"names compressed-tensors, but no module holds compressed-tensors's tensors "
                                         r"\(weight, weight_scale\)"):
        list(int_weights([("a.weight", torch.zeros(4, 4))], _scheme(DYNAMIC)))


def test_weight_only_int_quantized_reads_as_integer_weights():
    scheme = _scheme(_group(DYNAMIC, input_activations=None))
    (name, t), = int_weights(_module("a").items(), scheme)
    a = _module("a")
    assert isinstance(t, IntTensor) and (t.bits, t.symmetric) == (8, True)
    assert torch.equal(t.dequantize(), a["a.weight"].float() * a["a.weight_scale"].float())


# -- a checkpoint directory ----------------------------------------------------------------------------------------


def _config_dir(path: Path, qc: dict | None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | SIZES
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config | ({"quantization_config": qc} if qc else {})))
    if tensors:
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("asked, want", [("auto", "compressed-tensors"), ("compressed-tensors", "compressed-tensors"),
                                         ("none", "none")])
def test_the_checkpoint_names_its_method_and_a_flag_may_force_it(asked, want, tmp_path):
    from ember.config import _quantization
    from ember.loader.model_files import ModelFiles

    assert _quantization(asked, ModelFiles(_config_dir(tmp_path, DYNAMIC), "safetensors"), "cpu") == want


def test_an_int8_tensor_without_a_quantization_config_is_refused(tmp_path):
    from ember import LLM

    path = _config_dir(tmp_path, None, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 256,
                                                                                               dtype=torch.int8)})
    with pytest.raises(ValueError, match="tensor 'model.layers.0.self_attn.q_proj.weight' is int8 with no scale paired "
                                         "to it: an int8 \\(W8A8\\) checkpoint's config.json names its scheme"):
        LLM(str(path), num_kv_blocks=8, block_size=8, max_model_len=64)


@pytest.mark.parametrize("qc", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_dummy_weights_under_a_w8a8_config_are_quantized_at_load(qc, tmp_path):
    """Benchmarks' dummy weights at a W8A8 checkpoint's shapes: every linear layer but what the
    ignore-list names in int8 (static: a fixed input scale), the LM head dense; they generate."""
    from ember import LLM, SamplingParams

    llm = LLM(str(_config_dir(tmp_path, qc)), load_format="dummy", num_kv_blocks=8, block_size=8, max_model_len=64)
    assert llm.config.quantization == "compressed-tensors"
    model = llm.engine.runner.model
    layers = [(i, m) for i, layer in enumerate(model.model.layers) for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    ignored = [] if qc is DYNAMIC else [model.model.layers[0].mlp.down_proj]
    for i, m in layers:
        assert isinstance(m.format, W8A8Weight) != any(m is x for x in ignored)
        if isinstance(m.format, W8A8Weight):
            assert (m.format.input_scale is None) == (qc is DYNAMIC)
            assert qc is DYNAMIC or m.format.input_scale.item() == pytest.approx(DUMMY_INPUT_SCALE)
    assert not isinstance(model.lm_head.format, W8A8Weight)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
