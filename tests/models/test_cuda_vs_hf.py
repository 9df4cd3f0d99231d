"""On CUDA (`-m gpu`): ember's bfloat16 engine (Triton attention, fused ops, CUDA graphs)
against HF transformers on the same random weights saved as safetensors.

- logits of a batch of prompts within bfloat16 tolerance of HF's float32 logits;
- greedy generation: HF, fed ember's tokens (teacher forcing), picks the same next token
  at >= 95 % of the positions;
- batch invariance: each prompt alone vs in the batch, greedy; reported (decode split
  counts depend on the padded batch size, so bf16 rounding may differ);
- with an fp8 KV cache: logits and greedy agreement with HF, reported, loosely bounded."""

from __future__ import annotations

import json

import pytest
import torch
from hf_agreement import greedy_agreement, logits_agreement

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 8192, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 1e6,
    "tie_word_embeddings": True, "use_sliding_window": False, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from ember import LLM
    from ember.loader.dummy import iter_dummy_weights
    from ember.models.config import ModelConfig

    path = tmp_path_factory.mktemp("qwen3-small")
    (path / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_hf_config(CONFIG)
    # weights rounded to bfloat16 once, so both engines hold exactly the same numbers
    weights = {n: t.to(torch.bfloat16).contiguous() for n, t in iter_dummy_weights(cfg, seed=11)}
    save_file(weights, str(path / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=16, gpu_memory_utilization=0.3)
    assert llm.config.dtype == "bfloat16" and llm.config.attention_backend == "triton"
    assert llm.engine.runner.graphs is not None
    return llm, hf


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 64, 129, 300, 1, 45, 250][:n]
    return [torch.randint(3, CONFIG["vocab_size"], (n_,), generator=g).tolist() for n_ in lengths]


def test_logits_match_hf_in_bf16(models, forward_logits):
    llm, hf = models
    assert logits_agreement("bf16", llm, hf, _prompts(8), forward_logits) >= 0.95


def test_greedy_generation_agrees_with_hf(models):
    llm, hf = models
    assert greedy_agreement("bf16", llm, hf, _prompts(8, seed=1)) >= 0.95


def test_batch_invariance_report(models):
    from ember import SamplingParams

    llm, _ = models
    prompts = _prompts(8, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    alone = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    same = sum(a == b for a, b in zip(alone, batched))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(alone, batched)]
    print(f"batch invariance: {same}/{len(prompts)} sequences identical alone vs in a batch of {len(prompts)}; "
          f"first differing position per sequence: {first}")
    llm.check_idle()


@pytest.fixture(scope="module")
def fp8_llm(models):
    """The same weights with an fp8 KV cache (scale 1.0); a fixed pool beside the first engine's."""
    from ember import LLM

    llm, _ = models
    fp8 = LLM(llm.config.model, max_model_len=1024, max_num_seqs=16, num_kv_blocks=1024, kv_cache_dtype="fp8")
    assert fp8.engine.runner.kv_cache.dtype == torch.float8_e4m3fn and fp8.engine.runner.graphs is not None
    return fp8


def test_fp8_kv_logits_and_greedy_stay_close_to_hf(models, fp8_llm, forward_logits):
    """What the fp8 KV cache costs against HF in float32 (printed), with loose bounds: the
    bf16 engine itself is within 2 % of the mean |logit| and agrees on >= 95 % of argmaxes.
    Measured on the H200: mean |logit diff| 0.025-0.029 (bf16 KV: 0.005-0.006; mean |logit|
    0.51), argmax agreement 714/809 = 88.3 %, greedy tokens HF agrees with 355/384 = 92.4 %."""
    _, hf = models
    assert logits_agreement("fp8 KV", fp8_llm, hf, _prompts(8), forward_logits, rel=0.1, abs_=0.05) >= 0.8
    assert greedy_agreement("fp8 KV", fp8_llm, hf, _prompts(8, seed=1)) >= 0.8
    fp8_llm.check_idle()
