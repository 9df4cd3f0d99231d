"""Mixtures of experts from GGUF files made by llama.cpp's own converter: Mixtral (written as
architecture "llama" with experts), Qwen3-MoE (norm_topk_prob) and Qwen2-MoE (a shared expert
with its sigmoid gate), tiny random models saved by HF transformers and converted to f32 (and
one to f16, from weights that f16 holds exactly), give transformers' logits and greedy tokens
on the HF directory (float32). The converter stacks each layer's experts
(blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps) and writes every layer sparse, so the Qwen
models here have no dense layer (it cannot convert one)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from family_checks import PROMPTS, assert_logits_match
from test_families import save_tiny_model
from test_moe import MOE, assert_greedy_matches_hf

from ember import LLM, SamplingParams
from ember.loader.gguf import open_gguf
from ember.loader.gguf_experts import split_experts
from ember.loader.model_files import ModelFiles
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

# name -> (HF config, outtype). vocab_size: the tokenizer's. Mixtral takes the SentencePiece
# tokenizer (its converter class is Llama's); the Qwen MoE converters read a BPE tokenizer only.
SPM_VOCAB, BPE_VOCAB = 512, 49152
GGUF_MOE = {
    "mixtral": (MOE["mixtral"] | {"vocab_size": SPM_VOCAB}, "f32"),
    "qwen3_moe": (MOE["qwen3_moe"] | {"vocab_size": BPE_VOCAB, "mlp_only_layers": []}, "f32"),
    "qwen2_moe": (MOE["qwen2_moe"] | {"vocab_size": BPE_VOCAB, "mlp_only_layers": []}, "f32"),
    "qwen2_moe_f16": (MOE["qwen2_moe"] | {"vocab_size": BPE_VOCAB, "mlp_only_layers": []}, "f16"),
}
# what ModelConfig reads from each file: (family, sparse layers, experts, per token, expert
# intermediate, renormalized, shared expert intermediate)
EXPECTED = {
    "mixtral": ("mixtral", (True,) * 4, 8, 2, 96, True, 0),
    "qwen3_moe": ("qwen3_moe", (True,) * 4, 16, 6, 32, True, 0),
    "qwen2_moe": ("qwen2_moe", (True,) * 4, 8, 3, 32, False, 80),
    "qwen2_moe_f16": ("qwen2_moe", (True,) * 4, 8, 3, 32, False, 80),
}


def save_for_conversion(config: dict, path, tokenizer_dir, f16_exact: bool = False) -> None:
    """The tiny model's HF directory, with the tokenizer files the converter reads; f16_exact:
    every weight rounded through float16 (an f16 GGUF then holds the same numbers)."""
    save_tiny_model(config, path)
    if f16_exact:
        weights = load_file(str(path / "model.safetensors"))
        save_file({n: t.half().float() for n, t in weights.items()}, str(path / "model.safetensors"))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)


@pytest.fixture(scope="module", params=sorted(GGUF_MOE))
def converted(request, tmp_path_factory, gguf_convert, spm_tokenizer_dir, bpe_tokenizer_dir):
    name = request.param
    config, outtype = GGUF_MOE[name]
    path = tmp_path_factory.mktemp(name)
    save_for_conversion(config, path, spm_tokenizer_dir if name == "mixtral" else bpe_tokenizer_dir,
                        f16_exact=outtype == "f16")
    gguf = gguf_convert(path, outtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(gguf), num_kv_blocks=64, block_size=8, max_model_len=256, kv_cache_dtype="float32")
    return name, gguf, hf, llm


@pytest.mark.slow
def test_the_converter_wrote_stacked_experts_and_the_config_reads_them(converted):
    name, gguf, _, _ = converted
    f = open_gguf(gguf)
    assert f.architecture == {"mixtral": "llama"}.get(name, name.removesuffix("_f16").replace("_", ""))
    config, outtype = GGUF_MOE[name]
    experts, inter, hidden = config.get("num_experts") or config["num_local_experts"], EXPECTED[name][4], 64
    assert {n: (f.tensor_info(n).shape, f.tensor_info(n).qtype_name) for n in f.tensor_names
            if n.startswith("blk.3.ffn_") and "exps" in n} == {
        "blk.3.ffn_gate_exps.weight": ((experts, inter, hidden), outtype.upper()),
        "blk.3.ffn_up_exps.weight": ((experts, inter, hidden), outtype.upper()),
        "blk.3.ffn_down_exps.weight": ((experts, hidden, inter), outtype.upper()),
    }
    assert ("blk.3.ffn_gate_inp_shexp.weight" in f.tensor_names) == name.startswith("qwen2_moe")
    cfg = ModelFiles(gguf, "gguf").model_config()
    assert (cfg.architecture, cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, cfg.shared_expert_intermediate_size) == EXPECTED[name]
    # every other field as from config.json, but for the epsilon the file holds as float32
    assert replace(cfg, rms_norm_eps=1e-6) == ModelConfig.from_hf_config(config)


@pytest.mark.slow
def test_gguf_moe_logits_match_hf(converted, forward_logits):
    _, _, hf, llm = converted
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.slow
def test_gguf_moe_greedy_matches_hf(converted):
    _, _, hf, llm = converted
    assert_greedy_matches_hf(llm, hf)


@pytest.mark.slow
def test_q8_0_experts_are_dequantized_into_the_stacked_weights(tmp_path_factory, gguf_convert, spm_tokenizer_dir):
    """The converter's Q8_0 file quantizes the stacked experts too (blocks of 32 along each
    row): they come out dequantized, each expert within a Q8_0 step of its HF weight (a swapped
    or transposed expert is off by the weights' whole size), and the model generates."""
    path = tmp_path_factory.mktemp("mixtral_q8_0")
    save_for_conversion(GGUF_MOE["mixtral"][0], path, spm_tokenizer_dir)
    gguf = gguf_convert(path, "q8_0")
    f = open_gguf(gguf)
    assert f.tensor_info("blk.0.ffn_down_exps.weight").qtype_name == "Q8_0"
    hf = load_file(str(path / "model.safetensors"))
    llm = LLM(str(gguf), num_kv_blocks=16, block_size=8, max_model_len=64)
    moe = llm.engine.runner.model.get_submodule("model.layers.2.mlp")
    inter = moe.intermediate_size
    for e in range(8):
        p = f"model.layers.2.block_sparse_moe.experts.{e}."
        for ours, theirs in ((moe.w13[e, :inter], hf[p + "w1.weight"]), (moe.w13[e, inter:], hf[p + "w3.weight"]),
                             (moe.w2[e], hf[p + "w2.weight"])):
            # Q8_0's step per block: its largest value / 127 (stored as float16, so rounding can
            # come to a little over half a step)
            step = theirs.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
            assert ((ours.reshape(-1, 32) - theirs.reshape(-1, 32)).abs() <= step).all()
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_q8_0_moe_gives_a_prompt_the_same_bits_however_it_is_batched(name, tmp_path_factory, gguf_convert,
                                                                   spm_tokenizer_dir, bpe_tokenizer_dir):
    """A mixture of experts as GGUF blocks (Q8_0; the stacked experts dequantized, the router
    and Qwen2-MoE's shared-expert gate float32 as the converter keeps them): batch invariance
    (tests/invariance.py), so each expert's rows and each token's sum over its experts must not
    depend on what else the step routes (layers/moe.py)."""
    from invariance import assert_batch_invariant, prompts_with_a_shared_prefix

    config, _ = GGUF_MOE[name]
    path = tmp_path_factory.mktemp(f"{name}_q8_0")
    save_for_conversion(config, path, spm_tokenizer_dir if name == "mixtral" else bpe_tokenizer_dir)
    gguf = gguf_convert(path, "q8_0")
    assert open_gguf(gguf).tensor_info("blk.0.ffn_down_exps.weight").qtype_name == "Q8_0"
    assert_batch_invariant(gguf, prompts_with_a_shared_prefix(min(config["vocab_size"], 2000)))


# -- the config from llama.cpp's keys, where the converter's files do not show each rule -------

def _qwen_md(arch: str, **keys) -> dict:
    md = {"general.architecture": arch, f"{arch}.block_count": 4, f"{arch}.context_length": 512,
          f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 96, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
          f"{arch}.expert_count": 8, f"{arch}.expert_used_count": 3, f"{arch}.vocab_size": 320}
    return md | {f"{arch}.{k}": v for k, v in keys.items()}


def test_gguf_moe_config_follows_llama_cpp_defaults():
    """Where a key lacks: the experts' intermediate size is feed_forward_length / used (Qwen)
    or feed_forward_length (llama), the shared expert's feed_forward_length; qwen2moe does not
    renormalize, qwen3moe and llama do; leading_dense_block_count keeps the first layers dense."""
    qwen2 = ModelConfig.from_gguf_metadata(_qwen_md("qwen2moe"), [])
    assert (qwen2.architecture, qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size,
            qwen2.norm_topk_prob) == ("qwen2_moe", 32, 96, False)
    qwen3 = ModelConfig.from_gguf_metadata(_qwen_md("qwen3moe", leading_dense_block_count=1), [])
    assert (qwen3.architecture, qwen3.moe_layers, qwen3.norm_topk_prob, qwen3.shared_expert_intermediate_size) == \
        ("qwen3_moe", (False, True, True, True), True, 0)
    unnormalized = ModelConfig.from_gguf_metadata(_qwen_md("qwen3moe", expert_weights_norm=False), [])
    assert unnormalized.norm_topk_prob is False
    mixtral = ModelConfig.from_gguf_metadata(_qwen_md("llama"), [])
    assert (mixtral.architecture, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == ("mixtral", 96, True)
    dense = ModelConfig.from_gguf_metadata(_qwen_md("llama", expert_count=0), [])
    assert (dense.architecture, dense.moe_layers) == ("llama", None)


@pytest.mark.parametrize(("md", "message"), [
    (_qwen_md("qwen3moe", expert_gating_func=2), "qwen3moe.expert_gating_func 2: ember routes experts by softmax"),
    (_qwen_md("qwen3moe", expert_weights_scale=2.5), "qwen3moe.expert_weights_scale 2.5: ember does not scale"),
    (_qwen_md("qwen2moe", expert_count=0), "GGUF metadata lacks qwen2moe.expert_count"),
    (_qwen_md("qwen2", expert_count=4), "this qwen2 GGUF is a mixture of 4 experts, which ember reads from GGUF "
                                        "architectures llama (Mixtral), qwen3moe and qwen2moe only"),
    (_qwen_md("qwen3_moe"), "unsupported GGUF architecture 'qwen3_moe'"),
])
def test_gguf_moe_refusals_say_what_is_wrong(md, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_gguf_metadata(md, [])


def test_fused_gate_up_experts_split_into_gate_and_up():
    """The converter's --fuse-gate-up-exps writes one [E, 2I, H] tensor, gate rows then up."""
    stacked = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)
    parts = dict(split_experts("blk.7.ffn_gate_up_exps.weight", stacked))
    assert list(parts) == [f"model.layers.7.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up")]
    for e in range(3):
        assert torch.equal(parts[f"model.layers.7.mlp.experts.{e}.gate_proj.weight"], stacked[e, :2])
        assert torch.equal(parts[f"model.layers.7.mlp.experts.{e}.up_proj.weight"], stacked[e, 2:])
    down = dict(split_experts("blk.0.ffn_down_exps.weight", stacked))
    assert torch.equal(down["model.layers.0.mlp.experts.2.down_proj.weight"], stacked[2])
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up_exps\.weight \(4, 5\) is not a stack of experts"):
        list(split_experts("blk.0.ffn_up_exps.weight", stacked[0]))
