"""The families beyond Llama, and every RoPE scaling, on tiny random models saved by HF
transformers: ember's logits and greedy tokens equal transformers' (float32). Sliding
windows are shorter than the prompts, and are also run through chunked prefill and a
prefix-cache hit. Partial RoPE (Phi-4-mini's), from HF files and from llama.cpp's GGUF."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.model_files import ModelFiles
from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

BASE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
LLAMA = BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 10000.0,
                "tie_word_embeddings": False}
WINDOW = 7  # shorter than most prompts below, and not a multiple of the block size (8)
PHI3 = BASE | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "rope_theta": 10000.0,
               "max_position_embeddings": 1024, "original_max_position_embeddings": 256, "tie_word_embeddings": False}
FAMILIES = {
    "gemma2": BASE | {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 32,
                      "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                      "sliding_window": WINDOW, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                      "rope_theta": 10000.0},
    "gemma3": BASE | {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32,
                      "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32,
                      "sliding_window": WINDOW, "num_hidden_layers": 6,
                      "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                      + ["full_attention"],
                      "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                             "rope_theta": 1000000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": PHI3 | {"sliding_window": 2 * WINDOW,
                    "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                     "long_factor": [2.0 + 0.5 * i for i in range(8)]}},
    # Phi-4-mini: RoPE on 3/4 of each head (12 of 16 dims), LongRoPE factors for those 12
    "phi3_partial": PHI3 | {"partial_rotary_factor": 0.75,
                            "rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                                             "long_factor": [2.0 + 0.7 * i for i in range(6)]}},
    "mistral_window": BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                              "rope_theta": 10000.0, "sliding_window": WINDOW, "tie_word_embeddings": False},
    "qwen2_window": BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 10000.0,
                            "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                            "tie_word_embeddings": True},
}
# each RoPE scaling on a Llama: one forward's logits (greedy tokens of a tiny random model
# hardly depend on the RoPE, the logits do)
ROPES = {
    "rope_linear": LLAMA | {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "rope_dynamic": LLAMA | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "rope_yarn": LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}},
    "rope_yarn_mscale": LLAMA | {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.707,
                                                  "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                                  "original_max_position_embeddings": 64}},
    # partial RoPE without scaling, the factor where transformers 5 writes it: among the RoPE parameters
    "rope_partial": PHI3 | {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}},
}
PROMPTS = [
    [5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3],
    [7],
    [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
]
MAX_TOKENS = 32


def save_tiny_model(config: dict, path) -> ModelConfig:
    """config.json and seeded random weights (safetensors) in `path`, as a checkpoint would be."""
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf_config(config)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=7)}, str(path / "model.safetensors"))
    return cfg


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def build(name: str, config: dict, tmp_path_factory, max_model_len: int = 256):
    path = tmp_path_factory.mktemp(name)
    cfg = save_tiny_model(config, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return cfg, hf, LLM(str(path), num_kv_blocks=128, block_size=8, max_model_len=max_model_len)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    # max_model_len 256: within Phi-3's trained context, where transformers uses LongRoPE's short factors
    cfg, hf, llm = build(request.param, FAMILIES[request.param], tmp_path_factory)
    expected = [hf_greedy(hf, ids, MAX_TOKENS) for ids in PROMPTS]
    return request.param, cfg, hf, llm, expected


def assert_logits_match(llm, hf, prompts, forward_logits):
    for ids, ours in zip(prompts, forward_logits(llm, prompts)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_hf_holds_exactly_the_tensors_ember_expects(family):
    _, cfg, hf, _, _ = family
    theirs = set(hf.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert set(hf_weight_shapes(cfg)) == theirs


def test_logits_match_hf(family, forward_logits):
    _, _, hf, llm, _ = family
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_scaling_logits_match_hf(name, tmp_path_factory, forward_logits):
    _, hf, llm = build(name, ROPES[name], tmp_path_factory)
    assert_logits_match(llm, hf, PROMPTS, forward_logits)


@pytest.mark.parametrize("name,length", [("phi3", 300), ("phi3_partial", 300), ("rope_dynamic", 600)])
def test_context_dependent_rope_beyond_the_trained_context(name, length, tmp_path_factory, forward_logits):
    """LongRoPE's long factors and dynamic NTK's larger base hold for a served context past
    the trained one; transformers picks them by the sequence's length, so a prompt of the
    served length gets the same RoPE from both."""
    config = (FAMILIES | ROPES)[name]
    _, hf, llm = build(name, config, tmp_path_factory, max_model_len=length)
    prompt = torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = forward_logits(llm, [prompt])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_greedy_matches_hf(family):
    _, _, _, llm, expected = family
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_chunked_prefill_and_prefix_hit_match_hf(family):
    """Prompts cut into 5-token chunks, then the same prompts again over their cached
    prefix: the window must see the same keys either way."""
    name, _, _, llm, expected = family
    chunked = LLM(llm.config.model, num_kv_blocks=128, block_size=8, max_num_batched_tokens=5, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    cached = []
    for attempt in range(2):
        outs = chunked.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert [o.outputs[0].token_ids for o in outs] == expected
        cached.append([o.num_cached_tokens for o in outs])
    # the second time, every whole block of a prompt (8 tokens) comes from the cache
    assert cached == [[0, 0, 0], [8, 0, 24]]


def test_config_reads_the_options():
    g2 = ModelConfig.from_hf_config(FAMILIES["gemma2"])
    assert (g2.layer_windows, g2.attn_logit_softcap, g2.final_logit_softcap) == ((7, None, 7, None), 5.0, 3.0)
    assert (g2.hidden_act, g2.norm_unit_offset, g2.sandwich_norms, g2.tie_word_embeddings) == \
        ("gelu_tanh", True, True, True)
    assert g2.attention_scale == 24 ** -0.5 and g2.embed_scale == 8.0
    g3 = ModelConfig.from_hf_config(FAMILIES["gemma3"])
    assert g3.layer_windows == (7, 7, None, 7, 7, None) and g3.qk_norm
    assert (g3.rope_theta, g3.rope_scaling.kind, g3.rope_scaling.factor, g3.local_rope_theta) == \
        (1e6, "linear", 8.0, 10000.0)
    phi = ModelConfig.from_hf_config(FAMILIES["phi3"])
    assert (phi.rope_scaling.kind, phi.rope_scaling.factor, phi.rope_scaling.original_max_position_embeddings) == \
        ("longrope", 4.0, 256)
    assert (phi.head_dim, phi.rotary_dim) == (16, 16)
    assert ModelConfig.from_hf_config(FAMILIES["phi3_partial"]).rotary_dim == 12
    assert ModelConfig.from_hf_config(ROPES["rope_partial"]).rotary_dim == 8
    assert ModelConfig.from_hf_config(FAMILIES["qwen2_window"]).layer_windows == (None, None, 7, 7)
    assert ModelConfig.from_hf_config(FAMILIES["mistral_window"]).layer_windows == (7,) * 4
    off = FAMILIES["qwen2_window"] | {"use_sliding_window": False}
    assert ModelConfig.from_hf_config(off).layer_windows is None


@pytest.mark.parametrize("config,message", [
    (LLAMA | {"architectures": ["FooForCausalLM"]}, "unsupported architecture 'FooForCausalLM'"),
    (LLAMA | {"rope_scaling": {"rope_type": "fancy", "factor": 2.0}},
     "unsupported rope_scaling type 'fancy'; ember supports default, linear, dynamic, yarn, longrope, llama3"),
    (FAMILIES["phi3"] | {"partial_rotary_factor": 0.75},
     "LongRoPE's short_factor has 8 entries; a RoPE over 12 dims of each head needs 6"),
    (LLAMA | {"partial_rotary_factor": 0.2}, "rotary_dim 3 must be even and within head_dim 16"),
    (FAMILIES["gemma2"] | {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
     "layer_types must list"),
])
def test_refusals_say_what_is_wrong(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_config(config)


def test_partial_rope_from_a_llama_cpp_gguf_matches_hf(tmp_path_factory, gguf_convert, spm_tokenizer_dir,
                                                       forward_logits):
    """llama.cpp's converter writes Phi-4-mini's partial RoPE as phi3.rope.dimension_count and
    the LongRoPE factors (rotary_dim / 2 each) as tensors: ember's model from the GGUF file
    gives transformers' logits."""
    path = tmp_path_factory.mktemp("phi3_partial_gguf")
    save_tiny_model(FAMILIES["phi3_partial"] | {"vocab_size": 512}, path)  # the SentencePiece tokenizer's
    for f in spm_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    gguf = gguf_convert(path, "f32")
    cfg = ModelFiles(gguf, "gguf").model_config()
    assert (cfg.architecture, cfg.head_dim, cfg.rotary_dim) == ("phi3", 16, 12)
    stored = torch.tensor(FAMILIES["phi3_partial"]["rope_scaling"]["short_factor"]).tolist()  # float32 in the file
    assert (cfg.rope_scaling.kind, list(cfg.rope_scaling.short_factor)) == ("longrope", stored)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert_logits_match(LLM(str(gguf), num_kv_blocks=64, block_size=8, max_model_len=256), hf, PROMPTS, forward_logits)
