"""Batch invariance on the path users get: the default model (SmolLM2 GGUF Q4_1) at its
default settings on the CPU (GGUF blocks, int8 activations, a float16 KV cache). A request's
greedy tokens and the logprob of each (its logits' bits) do not depend on what shares its
steps, on how its prompt is chunked, on a prefix-cache hit, or on being preempted and
recomputed. The reference is each request alone in an engine with the prefix cache off.

These are the cases the issue that asked for this found broken: a 1,500-token shared system
prompt with six suffixes, cache on against off; held-out prompts alone against a pool of 24
blocks at a 64-token budget (chunked prefill and preemption). The arithmetic behind it is
tested row by row in tests/kernels (attention, the block matmuls, norm, RoPE).
"""

from __future__ import annotations

import pytest
import torch
from cached_tokens import expected_cached, kv_tokens
from invariance import assert_same, results
from sampling import greedy

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a museum of printing. Answer briefly and say when you do not know. "
          "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined a "
          "screw press with movable metal type, oil-based ink and paper. ")
QUESTIONS = ["Who built the first press?", "What ink did it use?", "Why did books get cheaper?",
             "Name one city with an early press.", "What is movable type?", "How fast did printing spread?"]
HELD_OUT = [
    "Write a short story about a robot who learns to paint by the sea.",
    "List three reasons why people enjoy hiking in the mountains in summer.",
    "In mathematics, a prime number is a natural number greater than one that",
    "The recipe for a simple tomato soup needs ripe tomatoes, an onion and",
    "Dear hiring manager, I am writing to apply for the position of",
    "The ocean covers about seventy percent of the surface of the Earth and",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "The three primary colors of light are",
    "Once upon a time, in a small village at the edge of a great forest,",
]
MAX_TOKENS = 24


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams | None = None):
    return results(llm.generate([{"prompt_token_ids": p} for p in prompts],
                                params or greedy(MAX_TOKENS, ignore_eos=True, logprobs=0)))


@pytest.fixture(scope="module")
def engines(gguf_path, live_engines):
    """The reference (defaults, prefix cache off), the defaults as they are, and small ones."""
    made = {
        "alone": LLM(str(gguf_path), enable_prefix_caching=False),
        "default": LLM(str(gguf_path)),
        "tiny_pool": LLM(str(gguf_path), num_kv_blocks=24, max_num_batched_tokens=64),
        "budget_16": LLM(str(gguf_path), max_num_batched_tokens=16, enable_prefix_caching=False),
        "budget_200": LLM(str(gguf_path), max_num_batched_tokens=200),
    }
    live_engines.extend(made.values())
    yield made
    for llm in made.values():
        live_engines.remove(llm)


def test_the_engines_run_the_default_path(engines):
    c = engines["default"].config
    assert (c.quantization, c.torch_dtype, c.kv_cache_dtype) == ("gguf", torch.float32, "float16")
    assert engines["tiny_pool"].config.max_num_batched_tokens == 64


@pytest.fixture(scope="module")
def system_prompts(engines) -> list[list[int]]:
    tok = engines["alone"].get_tokenizer()
    system = tok.encode(SYSTEM * 30)[:1500]
    suffix = " Please answer in one short sentence that a child could read, and do not add more."
    prompts = [system + tok.encode(" Question: " + q + suffix)[:24] for q in QUESTIONS]
    assert len(system) == 1500 and [len(p) for p in prompts] == [1524] * 6
    return prompts


@pytest.fixture(scope="module")
def held_out(engines) -> list[list[int]]:
    tok = engines["alone"].get_tokenizer()
    return [tok.encode(p) for p in HELD_OUT]


@pytest.fixture(scope="module")
def alone(engines, system_prompts, held_out):
    """Every prompt on its own, prefix cache off: the reference."""
    llm = engines["alone"]
    return {"system": [run(llm, [p])[0] for p in system_prompts], "held_out": [run(llm, [p])[0] for p in held_out]}


def test_a_prefix_cache_hit_gives_the_uncached_answer(engines, system_prompts, alone):
    llm = engines["default"]
    warm = system_prompts[0][:1500] + llm.get_tokenizer().encode(" Question: what is a press?")
    seen = [kv_tokens(o) for o in llm.generate({"prompt_token_ids": warm}, greedy(4, ignore_eos=True))]
    outs = []  # one after another, after someone else's request a minute earlier
    for p in system_prompts:
        outs += llm.generate({"prompt_token_ids": p}, greedy(MAX_TOKENS, ignore_eos=True, logprobs=0))
        assert outs[-1].num_cached_tokens == expected_cached(p, seen) >= 1502  # the system prompt and " Question:"
        seen.append(kv_tokens(outs[-1]))
    assert_same(results(outs), alone["system"], "after a prefix-cache hit")
    outs = llm.generate([{"prompt_token_ids": p} for p in system_prompts],  # all six at once
                        greedy(MAX_TOKENS, ignore_eos=True, logprobs=0))
    assert all(o.num_cached_tokens == len(p) - 1 for o, p in zip(outs, system_prompts))
    assert_same(results(outs), alone["system"], "six at once on a shared cached prefix")


def test_a_mixed_batch_gives_each_request_its_answer_alone(engines, held_out, system_prompts, alone):
    """Ten short prompts and a 1,524-token one (chunked at the default budget beside them)."""
    llm = engines["alone"]
    got = run(llm, held_out + system_prompts[:1])
    assert_same(got, alone["held_out"] + alone["system"][:1], "in a mixed batch")


@pytest.mark.parametrize("budget", ["budget_16", "budget_200"])
def test_chunked_prefill_at_any_budget_gives_the_one_step_answer(engines, budget, system_prompts, held_out, alone):
    """At budget 16 (prefix cache off) one 1,524-token prompt and three short ones, each chunked
    at most 16 tokens a step; at budget 200 (cache on) two long prompts, the second waiting for
    the first's blocks and hitting them."""
    llm = engines[budget]
    long = 1 if budget == "budget_16" else 2  # each long prompt at 16 a step costs a full prefill
    got = run(llm, system_prompts[:long] + held_out[:3])
    assert_same(got, alone["system"][:long] + alone["held_out"][:3], f"chunked at {budget}")


def test_a_tiny_pool_preempts_and_every_request_keeps_its_answer(engines, held_out, alone):
    llm = engines["tiny_pool"]
    before = llm.engine.scheduler.num_preemptions
    got = run(llm, held_out)
    assert llm.engine.scheduler.num_preemptions > before
    assert_same(got, alone["held_out"], "preempted and recomputed in a pool of 24 blocks")


def test_a_seeded_sample_does_not_depend_on_its_batch(engines, held_out):
    """Temperature sampling with a seed: the request's own generator draws, and the logits it
    draws from are the same bits alone and in a batch."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
    want = run(engines["alone"], [held_out[0]], params)
    got = run(engines["default"], held_out[3:6] + [held_out[0]], params)[-1:]
    assert_same(got, want, "seeded sampling in a batch")
