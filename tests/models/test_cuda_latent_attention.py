"""On CUDA (`-m gpu`): DeepSeek-V2-Lite- and V3-like models (multi-head latent attention at
the real latent sizes, kv_lora_rank 512 + 64 RoPE dims: the Triton kernels over a 576-dim
one-head cache; DeepSeekMoE's routers into the fused MoE kernels) through the whole bfloat16
engine, CUDA graphs included, against HF transformers in float32 on the same weights: logits
within bfloat16 tolerance, and HF picks ember's greedy tokens at >= 90 % of positions (a
mixture of experts' routing flips where rounding moves a top-k choice: see
test_cuda_families.py's GREEDY_FLOOR)."""

from __future__ import annotations

import pytest
import torch
from hf_agreement import greedy_agreement, logits_agreement

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SIZES = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
         "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0, "rms_norm_eps": 1e-6, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 256, "n_shared_experts": 2,
         "num_experts_per_tok": 4, "first_k_dense_replace": 1, "tie_word_embeddings": False, "rope_theta": 10000.0}
CONFIGS = {
    "v2_lite": SIZES | {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "q_lora_rank": None,
                        "n_routed_experts": 16, "topk_method": "greedy", "routed_scaling_factor": 1.0},
    "v3": SIZES | {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "q_lora_rank": 384,
                   "n_routed_experts": 32, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                   "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                   "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                    "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    transformers = pytest.importorskip("transformers")
    from test_latent_attention import save_deepseek

    from ember import LLM

    path = tmp_path_factory.mktemp(request.param)
    save_deepseek(CONFIGS[request.param], path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.3)
    assert llm.config.attention_backend == "triton" and llm.engine.runner.graphs is not None
    return request.param, llm, hf


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 8192, (n,), generator=g).tolist() for n in (3, 17, 129, 300, 1, 250)]


def test_logits_match_hf_in_bf16(models, forward_logits):
    name, llm, hf = models
    assert logits_agreement(name, llm, hf, _prompts(0), forward_logits) >= 0.95


def test_greedy_generation_agrees_with_hf(models):
    name, llm, hf = models
    assert greedy_agreement(name, llm, hf, _prompts(1)) >= 0.90
