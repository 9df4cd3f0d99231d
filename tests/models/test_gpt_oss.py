"""gpt-oss (GptOssForCausalLM) on a tiny random model saved by transformers: attention sinks
(a learned softmax logit a head, in the C++ kernel and the plain-torch matmuls), every other
layer a sliding window shorter than the prompts, q/k/v/o biases, YaRN without truncation,
and experts with biases under the clamped SwiGLU, routed by softmax over the top-k router
logits. Every bias and sink is moved off transformers' zero init so that each one counts:
ember's logits and greedy tokens equal transformers' (float32), through chunked prefill and a
prefix hit. And the experts as gpt-oss ships them, MXFP4 blocks and scales: decoded as
transformers' own decoder does, and served equal to transformers on the decoded weights, or
kept as blocks and scales in the layout the CUDA kernels read; dummy weights at MXFP4 shapes;
and from the GGUF llama.cpp's converter writes of each."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import (
    ENGINE,
    PROMPTS,
    assert_chunked_and_cached,
    assert_logits_match,
    assert_matches_hf,
    greedy_tokens,
    hf_greedy,
)

from ember import LLM
from ember.layers.quant.mxfp4 import E2M1, dequantize_mxfp4
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

pytestmark = pytest.mark.slow

WINDOW = 7


def _config():
    return transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 128, "rope_theta": 150000.0})


def _model(config, seed: int) -> torch.nn.Module:
    """transformers' model of `config`, its norms, biases and sinks moved off their init."""
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.5 * torch.randn_like(p))
    return hf


def _save(path) -> torch.nn.Module:
    hf = _model(_config(), seed=0)
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = _save(path)
    return path, hf, [hf_greedy(hf, ids) for ids in PROMPTS]


def test_config_reads_gpt_oss():
    cfg = ModelConfig.from_hf_config(json.loads(_config().to_json_string()) | {"architectures": ["GptOssForCausalLM"]})
    assert (cfg.architecture, cfg.attention_sinks, cfg.attention_bias, cfg.o_proj_bias, cfg.moe_bias) == \
        ("gpt_oss", True, True, True, True)
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None) and cfg.swiglu == (1.702, 7.0)
    assert not cfg.mxfp4_experts
    released = json.loads(_config().to_json_string()) | {"architectures": ["GptOssForCausalLM"],
                                                         "quantization_config": {"quant_method": "mxfp4"}}
    assert ModelConfig.from_hf_config(released).mxfp4_experts
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.truncate, cfg.rope_theta) == ("yarn", False, 150000.0)


def test_logits_and_greedy_match_hf(model, forward_logits):
    path, hf, expected = model
    assert_matches_hf(LLM(str(path), **ENGINE), hf, forward_logits, expected)


def test_chunked_prefill_and_prefix_hit(model):
    path, _, expected = model
    assert_chunked_and_cached(str(path), expected)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> MXFP4 (blocks, scales): each 32 values' scale the power of two that
    brings their largest to at most 6 (e2m1's largest), each value its nearest e2m1 code."""
    groups = w.reshape(*w.shape[:-1], -1, 32).float()
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1)
    codes = (scaled.unsqueeze(-1) - grid).abs().argmin(-1).to(torch.uint8)  # -0.0 never wins over +0.0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_decodes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 137, (3, 8, 4), generator=g, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    w = torch.randn(2, 6, 64, generator=g)
    decoded = dequantize_mxfp4(*pack_mxfp4(w))
    assert torch.equal(dequantize_mxfp4(*pack_mxfp4(decoded)), decoded)  # the packer's codes round-trip
    amax = w.reshape(2, 6, 2, 32).abs().amax(-1, keepdim=True).expand(2, 6, 2, 32).reshape(2, 6, 64)
    assert ((decoded - w).abs() <= amax / 3).all()  # half e2m1's widest step (2 of 6) at a scale below amax / 3


def _mxfp4_checkpoints(path, tmp_path):
    """The saved model's experts packed as gpt-oss ships them ([E, out, in / 32, 16] blocks with
    gate and up rows interleaved, [E, out, in / 32] scales; quantization_config mxfp4), the rest
    dense; and the same model with those experts decoded, dense: (mxfp4 dir, dense dir)."""
    state = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    packed, decoded = {}, dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(state[name].transpose(1, 2))  # transformers' [E, in, out] -> [E, out, in]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        decoded[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
        del state[name]
    mxfp4 = tmp_path / "mxfp4"
    dense = tmp_path / "dense"
    for root, tensors, extra in ((mxfp4, state | packed, {"quantization_config": {"quant_method": "mxfp4"}}),
                                 (dense, decoded, {})):
        root.mkdir()
        (root / "config.json").write_text(json.dumps(config | extra))
        save_file(tensors, str(root / "model.safetensors"))
    return mxfp4, dense


def test_mxfp4_experts_load(model, tmp_path, forward_logits):
    """On the CPU ember decodes the MXFP4 experts at load; transformers runs the same decoded
    weights dense."""
    mxfp4, dense = _mxfp4_checkpoints(model[0], tmp_path)
    hf = transformers.GptOssForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    assert_logits_match(LLM(str(mxfp4), **ENGINE), hf, PROMPTS, forward_logits)


@torch.inference_mode()
def test_mxfp4_experts_kept_quantized_as_on_cuda(model, tmp_path):
    """The layout the fused MXFP4 kernels read (what load_model keeps on CUDA): each layer's
    w13 / w2 blocks and scales, gate rows then up rows. Decoded, they equal the weights the CPU
    load decodes, and the layer's torch path equals the dense model's exactly (that the kernels
    read these parameters as dequantize_mxfp4 does: tests/kernels/test_moe_kernels.py)."""
    from ember.layers.attention import get_attention_backend
    from ember.loader.model_files import ModelFiles, load_model
    from ember.loader.weights import load_weights
    from ember.models.llama import LlamaForCausalLM

    mxfp4, _ = _mxfp4_checkpoints(model[0], tmp_path)
    files = ModelFiles(mxfp4, "safetensors")
    cfg = files.model_config()
    assert cfg.mxfp4_experts
    dense = load_model(files, cfg, 64, torch.float32, "cpu", "torch")  # off CUDA: decoded at load
    assert dense.model.layers[0].mlp.w13.dtype == torch.float32
    kept = LlamaForCausalLM(cfg, 64, get_attention_backend("torch"))
    load_weights(kept, files.weights(cfg, 0), source=str(mxfp4))
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for ours, theirs in zip(kept.model.layers, dense.model.layers):
        assert ours.mlp.w13_blocks.dtype == torch.uint8 and not hasattr(ours.mlp, "w13")
        assert ours.mlp.w13_blocks.shape == (8, 128, 32) and ours.mlp.w2_scales.shape == (8, 64, 2)
        assert torch.equal(ours.mlp._decoded("w13", torch.float32), theirs.mlp.w13)
        assert torch.equal(ours.mlp._decoded("w2", torch.float32), theirs.mlp.w2)
        assert torch.equal(ours.mlp(x), theirs.mlp(x))


def test_dummy_weights_at_mxfp4_shapes():
    """load_format dummy on an MXFP4 config (benchmarks/configs/gpt-oss-120b on CUDA): the
    experts as uint8 blocks and scales at the checkpoint's sizes, which the model's
    parameters take; gpt-oss-120b's experts are 60.9 GB so, of 116.8 B parameters."""
    import dataclasses
    import math
    from pathlib import Path

    from ember.layers.attention import get_attention_backend
    from ember.loader.dummy import iter_dummy_weights
    from ember.loader.weights import hf_weight_shapes, load_weights
    from ember.models.llama import LlamaForCausalLM

    big = ModelConfig.from_hf_dir(Path(__file__).parents[2] / "benchmarks/configs/gpt-oss-120b")
    assert big.mxfp4_experts and (big.num_experts, big.num_experts_per_tok, big.hidden_size) == (128, 4, 2880)
    shapes = hf_weight_shapes(big)
    assert shapes["model.layers.35.mlp.w13_blocks"] == (128, 5760, 1440)
    assert shapes["model.layers.35.mlp.w2_scales"] == (128, 2880, 90)
    assert sum(math.prod(v) for k, v in shapes.items() if k.endswith(("_blocks", "_scales"))) == 60_914_073_600
    dense = hf_weight_shapes(dataclasses.replace(big, mxfp4_experts=False))
    assert sum(math.prod(v) for v in dense.values()) == 116_829_156_672
    cfg = ModelConfig.from_hf_config(json.loads(_config().to_json_string()) | {
        "architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}})
    tiny = LlamaForCausalLM(cfg, 64, get_attention_backend("torch"))
    weights = dict(iter_dummy_weights(cfg))
    assert weights["model.layers.0.mlp.w13_blocks"].dtype == torch.uint8
    assert 119 <= weights["model.layers.0.mlp.w13_scales"].min() <= weights["model.layers.0.mlp.w13_scales"].max() <= 121
    load_weights(tiny, weights.items(), source="dummy")
    assert tiny.model.layers[0].mlp.w2_blocks.dtype == torch.uint8


@pytest.mark.parametrize("experts", ["dense", "mxfp4"])
def test_gguf_from_llama_cpps_converter(experts, tmp_path, gguf_convert, bpe_tokenizer_dir, forward_logits):
    """gpt-oss as llama.cpp users get it: llama.cpp's converter (the experts split into gate and
    up, their biases too; MXFP4 kept as GGML's MXFP4 blocks, decoded at load), with SmolLM2's BPE
    tokenizer. llama.cpp's YaRN rounds its correction range as transformers' default does
    (truncate), where gpt-oss's config says not to: the reference model here truncates too."""
    import shutil

    from ember.loader.gguf import open_gguf

    config = _config()
    config.vocab_size = 49152
    config.rope_parameters = config.rope_parameters | {"truncate": True}
    hf = _model(config, seed=4)
    root = tmp_path / experts
    hf.save_pretrained(str(root))
    if experts == "mxfp4":  # the experts as gpt-oss ships them; the reference runs their decoded values
        state = load_file(str(root / "model.safetensors"))
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = pack_mxfp4(state.pop(name).transpose(1, 2))
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            with torch.no_grad():
                hf.get_parameter(name).copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
        save_file(state, str(root / "model.safetensors"))
        meta = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps(meta | {"quantization_config": {"quant_method": "mxfp4"}}))
    for f in bpe_tokenizer_dir.iterdir():
        shutil.copy(f, root / f.name)
    path = gguf_convert(root, "f32")
    f = open_gguf(path)
    assert f.architecture == "gpt-oss" and "blk.0.attn_sinks.weight" in f.tensor_names
    assert f.tensor_info("blk.0.ffn_gate_exps.weight").qtype_name == ("MXFP4" if experts == "mxfp4" else "F32")
    llm = LLM(str(path), **(ENGINE | dict(num_kv_blocks=32, kv_cache_dtype="float32")))
    assert_logits_match(llm, hf, PROMPTS, forward_logits)
    assert greedy_tokens(llm) == [hf_greedy(hf, ids) for ids in PROMPTS]
