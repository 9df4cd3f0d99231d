"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): Llama's attention with q/k/v biases, RoPE on half of
each head and per-head q/k norms (use_qk_norm), over DeepSeek-V3's experts (sigmoid router
with the correction bias, groups, routed_scaling_factor, a shared expert, a dense first
layer), on a tiny random model whose file carries GLM's own names and a multi-token-prediction
layer (not read): ember's logits and greedy tokens equal transformers' (float32), through
chunked prefill and a prefix hit; and the same from the GGUF llama.cpp's converter writes
(glm4moe, which counts the prediction layer among its blocks)."""

from __future__ import annotations

import pytest
import torch
from family_checks import ENGINE, PROMPTS, assert_chunked_and_cached, assert_matches_hf, hf_greedy
from test_latent_attention import save_deepseek

from ember import LLM
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

GLM = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "moe_intermediate_size": 24, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
    "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "num_nextn_predict_layers": 1, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
KV32 = dict(kv_cache_dtype="float32")  # a GGUF's default cache on the CPU is float16


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe")
    save_deepseek(GLM, path, mtp_layer=True)
    return path, transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_config_reads_glms_options():
    cfg = ModelConfig.from_hf_config(GLM)
    assert (cfg.architecture, cfg.qk_norm, cfg.attention_bias, cfg.head_dim, cfg.rotary_dim, cfg.mla) == \
        ("glm4_moe", True, True, 16, 8, False)
    assert (cfg.moe_scoring, cfg.moe_groups, cfg.moe_topk_groups, cfg.routed_scaling_factor, cfg.norm_topk_prob) == \
        ("sigmoid", 2, 1, 2.5, True)
    assert cfg.moe_layers == (False, True, True) and cfg.shared_expert_intermediate_size == 24
    assert not ModelConfig.from_hf_config(GLM | {"use_qk_norm": False}).qk_norm


def test_hf_checkpoint_matches_transformers(glm, forward_logits):
    path, hf = glm
    assert_matches_hf(LLM(str(path), **ENGINE), hf, forward_logits)


def test_chunked_prefill_and_prefix_hit(glm):
    path, hf = glm
    assert_chunked_and_cached(str(path), [hf_greedy(hf, ids) for ids in PROMPTS])


def test_gguf_from_llama_cpps_converter_matches_transformers(tmp_path, gguf_convert, bpe_tokenizer_dir,
                                                           forward_logits):
    """The converter reads GLM's special tokens off the tokenizer: SmolLM2's BPE tokenizer (one
    it recognises) with them added."""
    from ember.loader.gguf import open_gguf

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bpe_tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<|user|>", "<|observation|>"]})
    tokenizer.save_pretrained(str(tmp_path))
    save_deepseek(GLM | {"vocab_size": len(tokenizer)}, tmp_path, mtp_layer=True)
    path = gguf_convert(tmp_path, "f32")
    f = open_gguf(path)
    assert (f.architecture, f.metadata["glm4moe.block_count"], f.metadata["glm4moe.nextn_predict_layers"]) == \
        ("glm4moe", 4, 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert_matches_hf(LLM(str(path), **(ENGINE | KV32 | dict(num_kv_blocks=32))), hf, forward_logits)
