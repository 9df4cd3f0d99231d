"""Llama 4 (text): chunked local attention on the RoPE layers, a NoPE layer with
temperature-tuned queries, q/k L2 norms, RoPE over interleaved pairs (llama3-scaled), top-1
experts whose sigmoid score scales their input beside an ungated shared expert, dense layers
between the sparse ones. A tiny random model made and saved by transformers (float32): ember's
logits and greedy tokens equal transformers', through chunked prefill and a prefix hit; the
multimodal checkpoint's language model loads the same (its vision tower not read)."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import ENGINE, PROMPTS, assert_chunked_and_cached, assert_matches_hf, hf_greedy

from ember import LLM
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CHUNK = 8  # one KV block of ENGINE's: prompts and outputs cross several chunks


def _text_config(**extra) -> dict:
    return dict(
        vocab_size=320, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=CHUNK, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0}) | extra


def _perturbed(hf: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norms off their init, weights wider than transformers' 0.02 (clear greedy choices)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4")
    hf = _perturbed(transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**_text_config())), seed=0)
    hf.save_pretrained(str(path))
    return path, hf, [hf_greedy(hf, ids) for ids in PROMPTS]


def test_config_reads_llama4s_layers():
    raw = json.loads(transformers.Llama4TextConfig(**_text_config()).to_json_string())
    cfg = ModelConfig.from_hf_config(raw | {"architectures": ["Llama4ForCausalLM"]})
    assert (cfg.architecture, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
            cfg.shared_expert_gate, cfg.moe_input_scaled, cfg.qk_norm, cfg.qk_l2_norm, cfg.rope_interleaved) == \
        ("llama4", 96, 32, 32, False, True, False, True, True)
    assert cfg.moe_layers == (False, True, False, True)
    assert cfg.nope_layers == (False, False, False, True) and cfg.layer_chunks == (CHUNK, CHUNK, CHUNK, None)
    assert cfg.attn_temperature == (0.5, 4.0) and cfg.rope_scaling.kind == "llama3"
    # the 128-expert model: no q/k norms, no temperature tuning; every layer global without a chunk size
    plain = ModelConfig.from_hf_config(raw | {"architectures": ["Llama4ForCausalLM"], "use_qk_norm": False,
                                              "attn_temperature_tuning": False, "attention_chunk_size": None,
                                              "layer_types": None})
    assert (plain.qk_l2_norm, plain.attn_temperature, plain.layer_chunks) == (False, None, None)
    with pytest.raises(ValueError, match="top-1"):
        ModelConfig.from_hf_config(raw | {"architectures": ["Llama4ForCausalLM"], "num_experts_per_tok": 2})


def test_hf_checkpoint_matches_transformers(model, forward_logits):
    path, hf, greedy = model
    assert_matches_hf(LLM(str(path), **ENGINE), hf, forward_logits, greedy)


def test_chunked_prefill_and_prefix_hit(model):
    path, _, greedy = model
    assert_chunked_and_cached(str(path), greedy)


def test_multimodal_checkpoint_serves_its_language_model(model, tmp_path, forward_logits):
    """Llama4ForConditionalGeneration (as Meta's Scout and Maverick ship): language_model.* under
    a text_config, beside a vision model and projector that ember does not read."""
    path, hf, greedy = model
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=_text_config(), vision_config=vision)
    full = transformers.Llama4ForConditionalGeneration(config).eval()
    full.language_model.load_state_dict(hf.state_dict())
    full.save_pretrained(str(tmp_path))
    names = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "model.safetensors.index.json").exists() else None
    assert names is None or any(n.startswith("vision_model.") for n in names)
    assert_matches_hf(LLM(str(tmp_path), **ENGINE), hf, forward_logits, greedy)


def test_gguf_from_llama_cpps_converter_matches_transformers(tmp_path, gguf_convert, bpe_tokenizer_dir,
                                                           forward_logits):
    """llama.cpp's converter writes llama4 with q and k as transformers stores them, the experts
    split from gate_up_proj, and reads back what its graph fixes rather than reads (chunks of
    8192, every fourth layer NoPE, temperature tuning (0.1, 8192), q/k norms below 128 experts):
    a model with those values, and llama3 RoPE scaling (rope_freqs), through an f32 file."""
    from ember.loader.gguf import open_gguf

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    tokenizer.save_pretrained(str(tmp_path))
    text = _text_config(vocab_size=len(tokenizer), attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1)
    hf = _perturbed(transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**text)), seed=1)
    hf.save_pretrained(str(tmp_path))
    path = gguf_convert(tmp_path, "f32")
    f = open_gguf(path)
    assert (f.architecture, f.metadata["llama4.interleave_moe_layer_step"], "rope_freqs.weight" in f.tensor_names) == \
        ("llama4", 2, True)
    cfg = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names, lambda name: f.tensor(name).tolist())
    assert (cfg.nope_layers, cfg.layer_chunks, cfg.attn_temperature, cfg.qk_l2_norm, cfg.moe_layers) == \
        ((False, False, False, True), (8192, 8192, 8192, None), (0.1, 8192.0), True, (False, True, False, True))
    assert_matches_hf(LLM(str(path), **(ENGINE | dict(kv_cache_dtype="float32", num_kv_blocks=32))), hf,
                      forward_logits)
