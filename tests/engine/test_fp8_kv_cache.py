"""`kv_cache_dtype="fp8"` end to end on the real SmolLM2 model (float32 compute, CPU, the
torch reference backend storing K/V as float8_e4m3fn with scale 1.0).

What fp8 costs here, measured once (torch 2.13 CPU), against float32 KV:
  - greedy, 24 tokens, the 12 prompts of test_batch_invariance: 6/12 sequences identical,
    11/12 first tokens; the other six part after 0, 1, 2, 5, 13 and 15 tokens.
  - prompt logits of the same 12 prompts: top-1 agreement 95% (88-100% per prompt), mean
    KL 0.0066 nats (largest at one position 0.075), mean |logit difference| 0.07-0.38.
  - a 289-token prompt's prompt logprobs: mean |difference| 0.032, max 0.97.
Greedy tokens are not asserted: fp8 rounding turns the ulp-level differences between batch
shapes (which float32 KV absorbs: tests/engine/test_batch_invariance.py) into a rounding
step of up to 6%, so even fp8 output can change with the batch. What is asserted is that
everything runs and the distributions stay close, with margins of several times the
measured values.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_batch_invariance import FORTY, PARAGRAPH, PROMPTS
from test_prefix_cache_e2e import QUESTIONS, SYSTEM, expected_cached, kv_tokens

from ember import EngineConfig, SamplingParams
from ember.config import CPU_KV_CACHE_MEMORY
from ember.runner.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # two more engines on the real model

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8_llm(extra_llm):
    """The default pool memory (1 GiB on the CPU), prefix caching off: one-step prefills."""
    return extra_llm(kv_cache_dtype="fp8", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def fp8_chunked(extra_llm):
    """A 128-token step budget (chunked prefill) and the prefix cache."""
    return extra_llm(kv_cache_dtype="fp8_e4m3", max_num_batched_tokens=128, num_kv_blocks=200)


def _bytes_per_block(gguf_path, **kw) -> int:
    cfg = EngineConfig(model=str(gguf_path), **kw).resolve()
    return ModelRunner.kv_bytes_per_block(types.SimpleNamespace(config=cfg, drafter=None))


def test_the_pool_is_fp8_and_holds_more_blocks(gguf_path, llm, fp8_llm):
    runner = fp8_llm.engine.runner
    assert fp8_llm.config.kv_cache_torch_dtype == FP8 and runner.kv_cache.dtype == FP8
    for attn in runner.model.attention_layers():
        assert attn.k_cache.dtype == attn.v_cache.dtype == FP8
        assert attn.k_scale.tolist() == attn.v_scale.tolist() == [1.0]  # vLLM's default without calibration
    # a block costs a quarter of float32's and half of bfloat16's: as many more blocks in the same memory
    fp8 = runner.kv_bytes_per_block()
    exact = {"quantization": "none"}  # the dequantized model: the cache is in its dtype
    assert _bytes_per_block(gguf_path, dtype="float32", **exact) == 4 * fp8 == llm.engine.runner.kv_bytes_per_block()
    assert _bytes_per_block(gguf_path, dtype="bfloat16", **exact) == 2 * fp8
    assert _bytes_per_block(gguf_path, dtype="bfloat16", kv_cache_dtype="fp8", **exact) == fp8
    # GGUF blocks (the default): float32 activations, a float16 cache as llama.cpp's
    assert _bytes_per_block(gguf_path) == 2 * fp8
    assert EngineConfig(model=str(gguf_path)).resolve().kv_cache_dtype == "float16"
    assert _bytes_per_block(gguf_path, kv_cache_dtype="bfloat16") == 2 * fp8
    assert runner.num_blocks == CPU_KV_CACHE_MEMORY // fp8 == fp8_llm.engine.block_pool.num_blocks
    assert runner.num_blocks >= 4 * llm.engine.runner.num_blocks
    assert runner.kv_cache.nbytes <= CPU_KV_CACHE_MEMORY


def test_greedy_runs_end_to_end_and_stays_close_to_float32_kv(llm, fp8_llm, forward_logits):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS + FORTY]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ids]
    got = fp8_llm.generate(prompts, params)
    assert all(o.finished and len(o.outputs[0].token_ids) == 24 for o in got)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same = sum(o.outputs[0].token_ids == w for o, w in zip(got, want))
    firsts = sum(o.outputs[0].token_ids[0] == w[0] for o, w in zip(got, want))
    # the distributions over every prompt position, fp8 KV against float32 KV
    kls, top1 = [], []
    for a, b in zip(forward_logits(llm, ids), forward_logits(fp8_llm, ids)):
        pa, pb = a.log_softmax(-1), b.log_softmax(-1)
        kls.append((pa.exp() * (pa - pb)).sum(-1))
        top1.append(a.argmax(-1) == b.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(top1).float().mean().item()
    print(f"fp8 vs float32 KV: {same}/{len(ids)} greedy sequences identical, {firsts} first tokens; "
          f"prompt top-1 agreement {agree:.3f}, mean KL {kl.mean():.5f}, max KL {kl.max():.4f}")
    assert kl.mean() < 0.05  # measured 0.0066
    assert kl.max() < 1.0  # measured 0.08


def _prompt_logprobs(out) -> torch.Tensor:
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])


def test_chunked_prefill_reads_its_fp8_prefix_like_one_step_prefill(llm, fp8_llm, fp8_chunked):
    """A 289-token prompt in 128-token chunks (each chunk attends to the fp8 KV the earlier
    ones wrote) against one step: the same per-position logprobs up to fp8
    rounding of ulp-level differences."""
    ids = llm.get_tokenizer().encode(PARAGRAPH * 6)
    assert len(ids) > 2 * 128
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    one = _prompt_logprobs(fp8_llm.generate({"prompt_token_ids": ids}, params)[0])
    chunked = _prompt_logprobs(fp8_chunked.generate({"prompt_token_ids": ids}, params)[0])
    diff = (one - chunked).abs()
    assert diff.mean() < 0.01 and diff.max() < 0.5, (diff.mean(), diff.max())  # measured 0.0014, 0.071


def test_prefix_cache_hits_reuse_fp8_blocks(fp8_llm, fp8_chunked):
    """Requests that share a system prompt reuse its fp8 blocks: the cached-token counts are
    the plain longest-common-prefix ones, and the first token's top-10 logprobs match those
    of a run without the prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=10)
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    first = fp8_chunked.generate(prompts[:3], params)
    second = fp8_chunked.generate(prompts, params)
    seen = [kv_tokens(o) for o in first]
    cached = [o.num_cached_tokens for o in second]
    assert cached == [expected_cached(o.prompt_token_ids, seen) for o in second]
    assert min(cached) >= 64
    off = fp8_llm.generate(prompts, params)
    assert all(o.num_cached_tokens == 0 for o in off)
    for hit, miss in zip(second, off):
        a, b = hit.outputs[0].logprobs[0], miss.outputs[0].logprobs[0]
        common = set(a) & set(b)
        assert len(common) >= 5
        assert max(abs(a[t].logprob - b[t].logprob) for t in common) < 0.1  # measured <= 0.009
