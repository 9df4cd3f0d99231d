"""The LayerNorm decoders the quick-starts begin with (vLLM's facebook/opt-125m, GPT-2, Phi-2)
on tiny random models saved by HF transformers, with every parameter perturbed so that the
LayerNorms' biases and the projections' biases count: ember's logits and greedy tokens equal
transformers' (float32), through chunked prefill and a prefix-cache hit too. Each loads from
the checkpoint names transformers writes and from the original files' (GPT-2's without the
`transformer.` prefix and with its causal-mask buffers, OPT's base model `decoder.*`)."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import (
    ENGINE,
    GREEDY,
    MAX_TOKENS,
    PROMPTS,
    assert_chunked_and_cached,
    assert_logits_match,
    greedy_tokens,
    hf_greedy,
)
from llama_cpp_tools import assert_greedy_agrees

from ember import LLM, SamplingParams
from ember.loader.weights import checkpoint_names, hf_weight_shapes
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

pytestmark = pytest.mark.slow

SIZES = dict(vocab_size=320, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # GPT-2: n_inner left null (4 x n_embd), learned positions, Conv1D weights
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=256, **SIZES),
    # OPT: positions from row 2 of their table, ReLU, q/k/v/out projections with biases
    "opt": lambda: transformers.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=3, num_attention_heads=4,
                                          max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=0,
                                          **SIZES),
    # Phi-2: RoPE on 40 % of each head (6 of 16 dims, as Phi-2's 32 of 80), attention and MLP side
    # by side after one LayerNorm, an LM head with a bias; two KV heads of four
    "phi": lambda: transformers.PhiConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          partial_rotary_factor=0.4, **SIZES),
}
CLASSES = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "phi": "PhiForCausalLM"}


def _save(name: str, path) -> torch.nn.Module:
    torch.manual_seed(3)
    hf = getattr(transformers, CLASSES[name])(CONFIGS[name]()).eval()
    with torch.no_grad():  # LayerNorms start at (1, 0) and biases at 0: move them all
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save(request.param, path)
    expected = [hf_greedy(hf, ids) for ids in PROMPTS]
    return request.param, path, hf, LLM(str(path), **ENGINE), expected


def test_ember_reads_every_tensor_transformers_writes(family):
    name, path, hf, llm, _ = family
    cfg = llm.engine.runner.model.config
    rename = checkpoint_names(cfg)
    theirs = {rename(n) for n in hf.state_dict()} - {None} - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(hf_weight_shapes(cfg)) == theirs
    assert ("model.layers.0.self_attn.qkv_proj.weight" in theirs) == (name == "gpt2")  # GPT-2's c_attn: q|k|v


def test_logits_match_hf(family, forward_logits):
    _, _, hf, llm, _ = family
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


def test_greedy_matches_hf(family):
    _, _, _, llm, expected = family
    assert greedy_tokens(llm) == expected


def test_chunked_prefill_and_prefix_hit_match_hf(family):
    """The learned positions and the partial RoPE follow each chunk's offset."""
    _, path, _, _, expected = family
    assert_chunked_and_cached(str(path), expected)


# the original checkpoints' names: gpt2's own files hold GPT2Model (no `transformer.` prefix)
# with each layer's causal-mask buffers; facebook/opt-125m's hold OPTModel (`decoder.*`)
ORIGINAL_NAMES = {"gpt2": ("transformer.", ""), "opt": ("model.decoder.", "decoder.")}


@pytest.mark.parametrize("name", sorted(ORIGINAL_NAMES))
def test_the_original_checkpoint_names_load(name, tmp_path, forward_logits):
    hf = _save(name, tmp_path)
    theirs, ours = ORIGINAL_NAMES[name]
    state = {n.replace(theirs, ours, 1): t.contiguous() for n, t in hf.state_dict().items() if n != "lm_head.weight"}
    if name == "gpt2":
        for i in range(hf.config.n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"))
    assert_logits_match(LLM(str(tmp_path), **ENGINE), hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dummy_weights_fill_the_model(name, tmp_path):
    """load_format dummy (the GPU benchmarks' random weights at real shapes) draws exactly
    the tensors the model has."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]().to_dict() | {"architectures": [CLASSES[name]]}))
    llm = LLM(str(tmp_path), load_format="dummy", **ENGINE)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_config_reads_each_familys_keys():
    gpt2 = ModelConfig.from_hf_config(CONFIGS["gpt2"]().to_diff_dict() | {"architectures": ["GPT2LMHeadModel"]})
    assert (gpt2.hidden_size, gpt2.intermediate_size, gpt2.num_layers, gpt2.num_heads, gpt2.head_dim) == \
        (64, 256, 3, 4, 16)
    assert (gpt2.hidden_act, gpt2.rms_norm_eps, gpt2.tie_word_embeddings, gpt2.max_position_embeddings) == \
        ("gelu_tanh", 1e-5, True, 256)
    assert (gpt2.layer_norm, gpt2.gated_mlp, gpt2.learned_positions, gpt2.position_offset, gpt2.attention_bias) == \
        (True, False, True, 0, True)
    opt = ModelConfig.from_hf_config(CONFIGS["opt"]().to_diff_dict() | {"architectures": ["OPTForCausalLM"]})
    assert (opt.intermediate_size, opt.hidden_act, opt.position_offset, opt.tie_word_embeddings) == (96, "relu", 2, True)
    phi = ModelConfig.from_hf_config(CONFIGS["phi"]().to_diff_dict() | {"architectures": ["PhiForCausalLM"]})
    assert (phi.rotary_dim, phi.num_kv_heads, phi.parallel_block, phi.lm_head_bias, phi.learned_positions) == \
        (6, 2, True, True, False)
    assert (phi.hidden_act, phi.tie_word_embeddings) == ("gelu_tanh", False)


@pytest.mark.parametrize("name,change,says", [
    ("opt", {"do_layer_norm_before": False}, "post-norm"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim 32"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "divided by the layer index"),
    ("gpt2", {"add_cross_attention": True}, "cross-attention"),
    ("phi", {"qk_layernorm": True}, "LayerNorm on q and k"),
])
def test_layouts_ember_does_not_run_are_refused_by_name(name, change, says):
    config = CONFIGS[name]().to_dict() | {"architectures": [CLASSES[name]]} | change
    with pytest.raises(ValueError, match=says):
        ModelConfig.from_hf_config(config)


# GPT-2 and Phi-2 as llama.cpp users get them: converted by llama.cpp's own convert_hf_to_gguf.py
# (f32), with SmolLM2's byte-level BPE tokenizer (one the converter recognises). The converter
# reads GPT-2's n_ctx, which the real gpt2 config.json carries and transformers 5 no longer
# writes, and writes Phi-2's feed_forward_length as 4 x n_embd (true of the real Phi-2).
GGUF_SIZES = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2)
GGUF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **GGUF_SIZES),
    "phi": lambda: transformers.PhiConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256,
                                          partial_rotary_factor=0.5, **GGUF_SIZES),
}
GGUF_PROMPTS = ["The quick brown fox", "def load(path):\n",
                "Every request has a prompt and a budget of new tokens; the scheduler gives each request a share"]
# a float32 KV cache (a GGUF's default on the CPU is float16, as llama.cpp's)
GGUF_ENGINE = ENGINE | dict(num_kv_blocks=32, kv_cache_dtype="float32")


@pytest.fixture(scope="module", params=sorted(GGUF_CONFIGS))
def converted(request, tmp_path_factory, gguf_convert, bpe_tokenizer_dir):
    import shutil

    name = request.param
    root = tmp_path_factory.mktemp(f"{name}-gguf")
    torch.manual_seed(5)
    hf = getattr(transformers, CLASSES[name])(GGUF_CONFIGS[name]()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(root))
    if name == "gpt2":
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps(config | {"n_ctx": config["n_positions"]}))
    for f in bpe_tokenizer_dir.iterdir():
        shutil.copy(f, root / f.name)
    return name, root, gguf_convert(root, "f32"), hf


def test_the_gguf_config_is_the_hf_one(converted):
    from ember.loader.gguf import open_gguf

    name, root, path, _ = converted
    f = open_gguf(path)
    assert f.architecture == {"gpt2": "gpt2", "phi": "phi2"}[name]
    assert ("blk.0.attn_qkv.weight" in f.tensor_names) == (name == "gpt2")  # Phi-2's q, k, v stay apart
    ours = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names)
    theirs = ModelConfig.from_hf_dir(root)
    different = {k for k in theirs.__dataclass_fields__ if getattr(ours, k) != getattr(theirs, k)}
    assert different == {"rms_norm_eps"}  # written as float32
    assert ours.rms_norm_eps == pytest.approx(1e-5)


def test_gguf_greedy_and_logits_match_transformers(converted, forward_logits):
    name, root, path, hf = converted
    from_gguf, from_dir = LLM(str(path), **GGUF_ENGINE), LLM(str(root), **GGUF_ENGINE)
    ours, theirs = from_gguf.generate(GGUF_PROMPTS, GREEDY), from_dir.generate(GGUF_PROMPTS, GREEDY)
    for a, b in zip(ours, theirs):
        ids = list(a.prompt_token_ids)
        assert ids == list(b.prompt_token_ids)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(hf, ids)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in ours]
    assert_logits_match(from_gguf, hf, sequences, forward_logits)


def test_gguf_greedy_matches_llama_cpp(converted, llama_greedy):
    """llama.cpp's own greedy tokens on the same file (where its llama-server is built), up to a
    near-tie of a random model's logits."""
    _, _, path, _ = converted
    llm = LLM(str(path), **GGUF_ENGINE)
    ours = llm.generate(GGUF_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5))
    theirs = llama_greedy(path, [list(o.prompt_token_ids) for o in ours], MAX_TOKENS, ctx=GGUF_ENGINE["max_model_len"])
    assert_greedy_agrees(ours, theirs.tokens)
