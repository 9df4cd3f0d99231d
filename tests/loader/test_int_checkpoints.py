"""AWQ, GPTQ and compressed-tensors pack-quantized checkpoints (loader/int_checkpoint.py,
loader/quant_config.py): each tool's quantization_config read as its scheme, every variant
ember does not read refused with a ValueError naming it, each module's tensors paired into
one IntTensor, and the method a checkpoint names chosen (or forced by a flag that fits it).
The models run against transformers in tests/models/test_int_weight_models.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from int_checkpoints import FORMS, SIZES, pack_ct, pack_gptq, quantization_config, quantize

from ember.layers.quant.int_weight import IntTensor
from ember.loader.int_checkpoint import IntScheme, int_weights
from ember.loader.quant_config import checkpoint_scheme

# -- quantization_config ------------------------------------------------------------------------------------------


def test_each_tools_config_reads_as_its_scheme():
    got = {name: checkpoint_scheme({"quantization_config": quantization_config(m, b, g, s, a, v1)})
           for name, (m, b, g, s, a, v1) in FORMS.items()}
    assert got["awq-g128"] == IntScheme("awq", 4, 128, False, False)
    assert got["gptq-int4-g128"] == IntScheme("gptq", 4, 128, False, True, zeros_minus_one=True)
    assert got["gptq-int4-asym-actorder-g64-v2"] == IntScheme("gptq", 4, 64, True, False, zeros_minus_one=False)
    assert got["gptq-int8-channel"] == IntScheme("gptq", 8, -1, False, True, zeros_minus_one=True)
    assert got["ct-w4a16-actorder-g64"] == IntScheme("compressed-tensors", 4, 64, True, True, ignore=("lm_head",))
    # AutoAWQ's own names (w_bit, q_group_size) and its upper-case version; Qwen's GPTQ configs
    assert checkpoint_scheme({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                      "zero_point": True, "version": "GEMM"}}).group_size == 64
    qwen = {"bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128, "is_marlin_format": False,
            "model_file_base_name": "model", "model_name_or_path": None, "quant_method": "gptq",
            "static_groups": False, "sym": True, "true_sequential": True}
    assert checkpoint_scheme({"quantization_config": qwen}) == IntScheme("gptq", 4, 128, False, True, True)


AWQ = quantization_config("awq", 4, 128, False, False)
GPTQ = quantization_config("gptq", 4, 128, True, False)
CT = quantization_config("compressed-tensors", 4, 128, True, False)


def _ct_weights(**change) -> dict:
    group = CT["config_groups"]["group_0"]
    return CT | {"config_groups": {"group_0": group | {"weights": group["weights"] | change}}}


@pytest.mark.parametrize("qc, error", [
    (AWQ | {"bits": 3}, "AWQ of 3 bits is not supported: ember reads 4-bit AWQ"),
    (AWQ | {"version": "gemv"}, "AWQ version 'gemv' is not supported: ember reads AutoAWQ's GEMM packing"),
    (AWQ | {"version": "gemv_fast"}, "AWQ version 'gemv_fast' is not supported"),
    (AWQ | {"version": "marlin"}, "AWQ version 'marlin' is not supported"),
    (AWQ | {"version": "exllama"}, "AWQ version 'exllama' is not supported"),
    (AWQ | {"zero_point": False}, r"AWQ without zero points \(zero_point False\) is not supported"),
    (AWQ | {"backend": "llm-awq"}, "AWQ backend 'llm-awq' .* is not supported"),
    (AWQ | {"group_size": 0}, "group_size must be a positive number of columns or -1"),
    (GPTQ | {"bits": 3}, "GPTQ of 3 bits is not supported: ember reads 4- and 8-bit GPTQ"),
    (GPTQ | {"bits": 2}, "GPTQ of 2 bits is not supported"),
    (GPTQ | {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported: ember reads the "
                                             r"'gptq' \(v1\) and 'gptq_v2' layouts"),
    (GPTQ | {"checkpoint_format": "bitblas"}, "GPTQ checkpoint_format 'bitblas' is not supported"),
    (GPTQ | {"is_marlin_format": True}, "GPTQ checkpoint_format 'marlin' is not supported"),
    (GPTQ | {"pack_dtype": "int16"}, "GPTQ pack_dtype 'int16' is not supported"),
    (GPTQ | {"dynamic": {"+:.*down": {"bits": 8}}}, "GPTQ with per-module `dynamic` overrides is not supported"),
    (CT | {"format": "int-quantized"}, "int-quantized .* weights of 4 bits, type 'int', are not supported: ember "
                                       "reads 8-bit int weights in int-quantized"),
    (CT | {"format": "marlin-24"}, "compressed-tensors format 'marlin-24' is not supported"),
    (CT | {"moe_sparsity_config": {"method": "prune", "num_experts": [6, 8]}}, "with a moe_sparsity_config "
                                                                               r"\(experts pruned or merged per layer"),
    (_ct_weights(num_bits=2), "weights of 2 bits, type 'int', are not supported"),
    (_ct_weights(type="float"), "weights of 4 bits, type 'float', are not supported"),
    (_ct_weights(strategy="tensor"), "weight strategy 'tensor' is not supported"),
    (_ct_weights(strategy="tensor_group"), "weight strategy 'tensor_group' is not supported"),
    (_ct_weights(group_size=None), "strategy group without a group_size"),
    (CT | {"config_groups": {"group_0": CT["config_groups"]["group_0"] | {"input_activations": {
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}}}},
     r"4-bit weights with int8 activations \(W4A8, pack-quantized\) are not supported: ember runs W8A8"),
    (CT | {"config_groups": {"a": CT["config_groups"]["group_0"], "b": _ct_weights(group_size=64)[
        "config_groups"]["group_0"]}}, "config groups with different weight schemes"),
    (CT | {"sparsity_config": {"format": "sparse-24-bitmask"}}, "with a sparsity_config is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported; ember "
                                                             "loads quant_method 'fp8'"),
])
def test_variants_ember_does_not_read_are_refused_by_name(qc, error):
    with pytest.raises(ValueError, match=error):
        checkpoint_scheme({"quantization_config": qc})


def test_the_librarys_own_configs_read_as_their_schemes(caplog):
    """config.json's quantization_config as compressed-tensors 0.20 writes it (ModelCompressor.
    update_config) for llm-compressor's presets: every key known, the scheme each names."""
    ct_checkpoints = pytest.importorskip("ct_checkpoints")
    with caplog.at_level(logging.WARNING):
        got = {form: checkpoint_scheme({"quantization_config": ct_checkpoints.quantization_config(form)})
               for form in ct_checkpoints.FORMS}
    assert caplog.text == ""
    lm_head = ("lm_head",)
    assert got["w4a16-g128"] == IntScheme("compressed-tensors", 4, 128, False, True, ignore=lm_head)
    assert got["w4a16-asym-g128"] == IntScheme("compressed-tensors", 4, 128, False, False, ignore=lm_head)
    assert got["w4a16-asym-g128"].parts == ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    assert got["w8a16-g128"] == IntScheme("compressed-tensors", 8, 128, False, True, ignore=lm_head)
    assert got["w8a16-channel"] == IntScheme("compressed-tensors", 8, -1, False, True, ignore=lm_head)
    assert got["w8a8-dynamic"] == IntScheme("compressed-tensors", 8, -1, False, True, layout="int-quantized",
                                            activations="dynamic", ignore=lm_head)
    assert got["w8a8-static"] == IntScheme("compressed-tensors", 8, -1, False, True, layout="int-quantized",
                                           activations="static", ignore=lm_head)


@pytest.mark.parametrize("form", ["w4a16-g32", "w4a16-asym-g128", "w8a16-channel", "w8a8-static-tensor"])
def test_the_librarys_checkpoints_read_as_its_own_dequantized_weights(form, tmp_path):
    """A checkpoint the library wrote (odd rows: 72 and 200), each module's weight as ember reads
    it equal to the library's own dequantizer's (W8A8: the int8 weight times its scale)."""
    from safetensors.torch import load_file, save_file

    ct_checkpoints = pytest.importorskip("ct_checkpoints")
    g = torch.Generator().manual_seed(0)
    source = tmp_path / "dense"
    source.mkdir()
    dense = {"model.layers.0.mlp.down_proj.weight": torch.randn(72, 256, generator=g),
             "model.layers.0.mlp.up_proj.weight": torch.randn(200, 128, generator=g),
             "model.layers.0.input_layernorm.weight": torch.ones(256), "lm_head.weight": torch.randn(8, 256)}
    save_file(dense, str(source / "model.safetensors"))
    (source / "config.json").write_text(json.dumps({"model_type": "llama"}))
    path = ct_checkpoints.write_checkpoint(source, tmp_path / form, form, input_amax={
        "model.layers.0.mlp.up_proj": 3.0})
    scheme = checkpoint_scheme(json.loads((path / "config.json").read_text()))
    ours = dict(int_weights(load_file(str(path / "model.safetensors")).items(), scheme, dequantize=True))
    assert sorted(ours) == sorted(dense)
    if scheme.activations:
        packed = load_file(str(path / "model.safetensors"))
        want = {n: packed[n].float() * packed[n.replace(".weight", ".weight_scale")].float() if packed[n].dtype ==
                torch.int8 else packed[n] for n in dense}
        assert packed["model.layers.0.mlp.up_proj.input_scale"].item() == pytest.approx(3.0 / 127.5)
    else:
        want = load_file(str(ct_checkpoints.dequantize_checkpoint(path) / "model.safetensors"))
    for name in dense:
        assert torch.equal(ours[name], want[name]), name
    assert (ours["model.layers.0.mlp.down_proj.weight"] - dense["model.layers.0.mlp.down_proj.weight"]).abs().max() \
        < (0.02 if "w8" in form else 0.3) * dense["model.layers.0.mlp.down_proj.weight"].abs().max()


def test_unknown_keys_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="ember.loader.fp8_checkpoint"):
        checkpoint_scheme({"quantization_config": GPTQ | {"new_knob": 1}})
    assert "quantization keys ember does not read: new_knob" in caplog.text


# -- pairing each module's tensors ---------------------------------------------------------------------------------


def _gptq_module(seed: int = 0, act: bool = False) -> dict[str, torch.Tensor]:
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(seed))
    return pack_gptq(quantize(w, 4, 32, False, act), v1=False)


SCHEME = IntScheme("gptq", 4, 32, False, False)


def test_parts_pair_in_any_order_and_other_tensors_pass_through():
    a, b = _gptq_module(1), _gptq_module(2)
    tensors = [("a.scales", a["scales"]), ("norm.weight", torch.ones(4)), ("b.qweight", b["qweight"]),
               ("a.qzeros", a["qzeros"]), ("a.g_idx", a["g_idx"]), ("b.g_idx", b["g_idx"]), ("b.qzeros", b["qzeros"]),
               ("a.qweight", a["qweight"]), ("b.bias", torch.zeros(64)), ("b.scales", b["scales"])]
    out = list(int_weights(tensors, SCHEME))
    assert [n for n, _ in out] == ["norm.weight", "a.weight", "b.bias", "b.weight"]  # each once its parts are in
    assert isinstance(out[1][1], IntTensor) and out[1][1].shape == (64, 128)
    dense = dict(int_weights(tensors, SCHEME, dequantize=True))
    assert torch.equal(dense["a.weight"], out[1][1].dequantize())


def test_a_gptq_module_without_g_idx_reads_its_groups_in_order_unless_act_order():
    a = _gptq_module()
    tensors = [(f"a.{k}", v) for k, v in a.items() if k != "g_idx"]
    assert [n for n, _ in int_weights(tensors, SCHEME)] == ["a.weight"]
    with pytest.raises(ValueError, match=r"1 quantized module\(s\) without all their parts: a \(no g_idx\)"):
        list(int_weights(tensors, IntScheme("gptq", 4, 32, True, False)))


@pytest.mark.parametrize("drop, error", [("qzeros", r"a \(no qzeros\)"), ("scales", r"a \(no scales\)")])
def test_a_module_without_a_part_is_refused_by_name(drop, error):
    with pytest.raises(ValueError, match=error):
        list(int_weights([(f"a.{k}", v) for k, v in _gptq_module().items() if k != drop], SCHEME))


def test_zero_points_in_a_symmetric_compressed_tensors_scheme():
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    module = [(f"a.{k}", v) for k, v in pack_ct(quantize(w, 4, 128, True)).items()]
    scheme = IntScheme("compressed-tensors", 4, 128, False, True)
    zeros = ("a.weight_zero_point", torch.zeros(64, 1, dtype=torch.int8))
    assert [n for n, _ in int_weights([zeros] + module, scheme)] == ["a.weight"]  # zeros some versions write: dropped
    with pytest.raises(ValueError, match="a.weight_zero_point: zero points in a symmetric scheme"):
        list(int_weights([("a.weight_zero_point", torch.ones(64, 1, dtype=torch.int8))] + module, scheme))


def test_an_asymmetric_compressed_tensors_module_pairs_its_zero_points():
    w = 0.05 * torch.randn(72, 128, generator=torch.Generator().manual_seed(0))
    qz = quantize(w, 4, 64, False)
    module = [(f"a.{k}", v) for k, v in pack_ct(qz).items()]
    scheme = IntScheme("compressed-tensors", 4, 64, False, False)
    (name, t), = int_weights(module, scheme)
    assert name == "a.weight" and torch.equal(t.zeros, qz.zeros.to(torch.uint8)) and torch.equal(
        t.dequantize(), qz.dequantized())
    with pytest.raises(ValueError, match=r"a \(no weight_zero_point\)"):
        list(int_weights([(n, v) for n, v in module if not n.endswith("zero_point")], scheme))


def test_a_kv_cache_schemes_scales_pass_to_the_attention_layers():
    """llm-compressor's W4A16 with an fp8 KV cache recipe: the k / v scales pass under their names
    (load_weights puts them in the attention layers: tests/models/test_kv_cache_scales.py)."""
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    scheme = checkpoint_scheme({"quantization_config": CT | {"kv_cache_scheme": kv}})
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    module = [(f"a.{k}", v) for k, v in pack_ct(quantize(w, 4, 128, True)).items()]
    scales = [("self_attn.k_scale", torch.ones(1)), ("self_attn.v_proj.output_scale", torch.ones(1))]
    assert [n for n, _ in int_weights(scales + module, scheme)] == ["self_attn.k_scale", "self_attn.v_proj.output_scale",
                                                                    "a.weight"]
    with pytest.raises(ValueError, match="kv_cache_scheme: num_bits 8, type 'int'"):
        checkpoint_scheme({"quantization_config": CT | {"kv_cache_scheme": kv | {"type": "int"}}})


def test_a_config_that_does_not_describe_its_tensors_is_refused():
    with pytest.raises(ValueError, match=r"quantization_config names gptq, but no module holds gptq's tensors "
                                         r"\(qweight, qzeros, scales\)"):
        list(int_weights([("a.weight", torch.zeros(4, 4))], SCHEME))


# -- choosing the quantization -------------------------------------------------------------------------------------


def _config_dir(path: Path, qc: dict | None) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} | SIZES
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config | ({"quantization_config": qc} if qc else {})))
    return path


@pytest.mark.parametrize("asked, qc, want", [
    ("auto", AWQ, "awq"), ("awq", AWQ, "awq"), ("none", AWQ, "none"), ("auto", GPTQ, "gptq"),
    ("auto", CT, "compressed-tensors"), ("compressed-tensors", CT, "compressed-tensors"),
])
def test_the_checkpoint_names_its_method_and_a_flag_may_force_it(asked, qc, want, tmp_path):
    from ember.config import _auto_dtype, _quantization
    from ember.loader.model_files import ModelFiles

    assert _quantization(asked, ModelFiles(_config_dir(tmp_path, qc), "safetensors"), "cpu") == want
    assert _auto_dtype("cpu", want) == "float32" or want == "none"


@pytest.mark.parametrize("asked, qc, error", [
    ("gptq", AWQ, "quantization='gptq' does not fit .*: its config.json's quantization_config is 'awq': use "
                  r"quantization='auto' \(or 'awq'\), or 'none'"),
    ("awq", CT, "quantization='awq' does not fit .* is 'compressed-tensors'"),
    ("fp8", GPTQ, "quantization='fp8' does not fit .* is 'gptq'"),
    ("awq", None, "quantization='awq' reads a checkpoint quantized so, and .* has no quantization_config"),
    ("compressed-tensors", {"quant_method": "fp8", "activation_scheme": "dynamic"},
     r"quantization='compressed-tensors' reads a checkpoint quantized so, and .* has an fp8 quantization_config"),
])
def test_a_method_that_does_not_fit_the_checkpoint_is_refused_by_name(asked, qc, error, tmp_path):
    from ember.config import _quantization
    from ember.loader.model_files import ModelFiles

    with pytest.raises(ValueError, match=error):
        _quantization(asked, ModelFiles(_config_dir(tmp_path, qc), "safetensors"), "cpu")


def test_a_family_whose_tensors_change_at_load_is_refused_by_name():
    from ember.loader.weights import check_int_family
    from ember.models.config import ModelConfig

    gpt2 = ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64,
                                       "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64})
    with pytest.raises(ValueError, match=r"gptq checkpoints of gpt2 are not supported yet: ember changes "
                                         r"its tensors at load \(its Conv1D weights turned to \[out, in\]\)"):
        check_int_family(gpt2, "gptq")


def test_dummy_weights_under_an_integer_config_are_quantized_at_load(tmp_path):
    """Benchmarks' dummy weights at an AWQ checkpoint's shapes: every linear layer rounded to its
    integers (GGUF blocks on the CPU), the LM head left dense."""
    from ember import LLM
    from ember.layers.quant.gguf_blocks import GGUFBlocks

    llm = LLM(str(_config_dir(tmp_path, AWQ)), load_format="dummy", num_kv_blocks=8, block_size=8, max_model_len=64)
    assert llm.config.quantization == "awq"
    model = llm.engine.runner.model
    layer = model.model.layers[1]
    formats = [layer.self_attn.qkv_proj.format, layer.self_attn.o_proj.format, layer.mlp.gate_up_proj.format,
               layer.mlp.down_proj.format]
    assert all(isinstance(f, GGUFBlocks) and f.type_name == "Q4_1" for f in formats)  # AWQ: zero points
    assert not isinstance(model.lm_head.format, GGUFBlocks)


def test_the_experts_of_an_integer_checkpoint_stay_packed_where_the_fused_kernels_run(caplog):
    """int_experts (what load_model keeps packed in FusedMoE): the scheme's bits, group size and
    symmetry where the fused MoE kernels run and every expert's projections are stored quantized;
    else None, logged with the reason: on the CPU, act-order groups, an expert stored plain;
    and None for a model without experts."""
    from ember.loader.int_checkpoint import int_experts
    from ember.models.config import ModelConfig

    qwen3_moe = ModelConfig.from_hf_config(
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **SIZES, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 128, "decoder_sparse_step": 1})
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")]
    stored = [f"{m}.{part}" for m in experts for part in ("qweight", "qzeros", "scales", "g_idx")]
    gptq = IntScheme("gptq", 4, 128, False, True, zeros_minus_one=True)
    assert int_experts(qwen3_moe, gptq, lambda: stored, True) == (4, 128, True)
    assert int_experts(qwen3_moe, IntScheme("awq", 4, 64, False, False), lambda: stored, True) == (4, 64, False)
    with caplog.at_level(logging.INFO, logger="ember.loader.int_checkpoint"):
        assert int_experts(qwen3_moe, gptq, lambda: stored, False) is None
        assert int_experts(qwen3_moe, IntScheme("gptq", 4, 128, True, True), lambda: stored, True) is None
        plain = [n for n in stored if not n.startswith("model.layers.1.mlp.experts.2.up_proj.")]
        assert int_experts(qwen3_moe, gptq, lambda: plain + ["model.layers.1.mlp.experts.2.up_proj.weight"],
                           True) is None
    assert [r.getMessage() for r in caplog.records] == [
        "gptq experts dequantized to the run dtype at load: on the CPU FusedMoE multiplies dense experts (GGUF "
        "experts are dequantized there too: no block-kept expert path)",
        "gptq experts dequantized to the run dtype at load: act-order groups (g_idx): the fused MoE kernels read "
        "each expert's groups in column order",
        "gptq experts dequantized to the run dtype at load: 1 of 24 expert projections are stored unquantized "
        "(e.g. model.layers.1.mlp.experts.2.up_proj)"]
    llama = ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES})
    assert int_experts(llama, gptq, lambda: stored, True) is None
