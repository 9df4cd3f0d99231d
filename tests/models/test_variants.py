"""Each member of the Llama family on seeded random weights (saved as safetensors) gives
HF transformers' logits: Llama 3 (RoPE scaling), Mistral, Qwen2 (q/k/v bias), Qwen3
(q/k norm, head_dim != hidden/heads), tied and untied embeddings."""

import json

import pytest
import torch

from ember import LLM, SamplingParams
from ember.loader.dummy import iter_dummy_weights
from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402

BASE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
}
VARIANTS = {
    "llama3": BASE | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
                      "tie_word_embeddings": False,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": BASE | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "rope_theta": 1e6,
                       "tie_word_embeddings": False, "sliding_window": None},
    "qwen2": BASE | {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1e6,
                     "tie_word_embeddings": True, "use_sliding_window": False},
    "qwen3": BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rope_theta": 1e6,
                     "head_dim": 32, "tie_word_embeddings": True, "use_sliding_window": False},
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 8], [7], [300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    config = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    (path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_hf_config(config)
    save_file({n: t.contiguous() for n, t in iter_dummy_weights(cfg, seed=7)}, str(path / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), num_kv_blocks=16, block_size=8, max_model_len=256, dtype="float32")
    return request.param, cfg, hf, llm


def test_config_reads_the_variant(variant):
    name, cfg, _, _ = variant
    assert cfg.architecture == {"llama3": "llama"}.get(name, name)
    assert cfg.attention_bias == (name == "qwen2")
    assert cfg.qk_norm == (name == "qwen3")
    assert cfg.head_dim == (32 if name == "qwen3" else 16)
    assert (cfg.rope_scaling is not None) == (name == "llama3")
    assert cfg.tie_word_embeddings == (name in ("qwen2", "qwen3"))


def test_hf_loads_every_tensor_we_wrote(variant):
    _, cfg, hf, _ = variant
    ours = set(hf_weight_shapes(cfg))
    theirs = set(hf.state_dict())
    assert ours == theirs - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())


def test_logits_match_hf(variant, forward_logits):
    _, _, hf, llm = variant
    for ids, ours in zip(PROMPTS, forward_logits(llm, PROMPTS)):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_greedy_matches_hf(variant):
    _, _, hf, llm = variant
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids[:len(expected)] == expected


def test_one_row_gemv_path_matches_hf(variant, forward_logits, monkeypatch):
    """A step of one row runs the linear layers on CUDA as ember's GEMV kernel with the
    norms and SiLU fused in (layers/fused.py). Forced onto the CPU (Triton's interpreter;
    unpacked weights), a one-token forward and greedy decoding one sequence at a time still
    give HF's answer."""
    pytest.importorskip("triton")
    from ember.layers.linear import gemv_on_cpu

    _, _, hf, packed = variant
    monkeypatch.setattr("ember.runner.model_runner.cpu_packing_supported", lambda dtype: False)
    llm = LLM(packed.config.model, num_kv_blocks=16, block_size=8, max_model_len=256, dtype="float32")
    assert all(m.format is None for m in llm.engine.runner.model.modules() if hasattr(m, "format"))
    with gemv_on_cpu():
        ours = forward_logits(llm, [PROMPTS[1]])[0]
        outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
                for p in PROMPTS]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[1]])).logits[0]
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    for ids, out in zip(PROMPTS, outs):
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()
