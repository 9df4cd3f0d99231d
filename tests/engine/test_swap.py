"""Preemption by swap (--preemption-mode swap / auto, --swap-space; scheduler/swap_space.py) on
the default model's batch-invariant path: a pool too small for the batch preempts, the preempted
requests' blocks go to host slots and come back, and every token and logprob is the run's with a
pool big enough; an abort while swapped out gives its slots back; auto recomputes short contexts."""

from __future__ import annotations

import pytest
from engine_steps import abort_one_when
from invariance import assert_same, results
from sampling import greedy

from ember import LLM
from ember.request import Request

pytestmark = pytest.mark.slow

SMALL = dict(num_kv_blocks=14, max_model_len=96)  # three requests that grow to 6 blocks each: preemptions


def prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(f"Count with me slowly: {', '.join(map(str, range(i, i + 14)))}")[:60]}
            for i in range(3)]


@pytest.fixture(scope="module")
def engines(gguf_path, live_engines):
    big = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=96)
    swap = LLM(str(gguf_path), **SMALL, preemption_mode="swap", swap_space=0.01)
    live_engines += [big, swap]
    yield big, swap
    for llm in (big, swap):
        live_engines.remove(llm)


def test_swapped_requests_come_back_with_the_tokens_of_a_pool_big_enough(engines):
    big, swap = engines
    params = greedy(30, ignore_eos=True, logprobs=0)
    want = big.generate(prompts(big), params)
    got = swap.generate(prompts(swap), params)
    assert_same(results(got), results(want), "swap")
    sched = swap.engine.scheduler
    assert sched.num_preemptions > 0 and sched.num_swapped == sched.num_preemptions  # every one by swap
    assert sched.swap.num_free == sched.swap.num_slots  # every slot back
    swap.engine.check_idle()
    swap.engine.prefix_cache.check_integrity()


def test_an_abort_while_swapped_out_gives_its_slots_back(engines):
    _, swap = engines
    core, sched = swap.engine, swap.engine.scheduler
    reqs = [Request(f"sw-{i}", p["prompt_token_ids"], greedy(30, ignore_eos=True)) for i, p in enumerate(prompts(swap))]
    gone = abort_one_when(core, reqs, lambda r: r.swapped is not None)
    assert gone.swapped is None and gone.finish_reason == "abort"
    assert all(len(r.output_token_ids) == 30 for r in reqs if r is not gone)
    assert sched.swap.num_free == sched.swap.num_slots
    core.check_idle()


def test_auto_recomputes_a_short_context(gguf_path, live_engines, engines):
    big, _ = engines
    auto = LLM(str(gguf_path), **SMALL, preemption_mode="auto", swap_space=0.01)
    live_engines.append(auto)
    try:
        params = greedy(30, ignore_eos=True, logprobs=0)
        assert_same(results(auto.generate(prompts(auto), params)), results(big.generate(prompts(big), params)),
                    "auto")
        sched = auto.engine.scheduler
        assert sched.num_preemptions > 0 and sched.num_swapped == 0  # contexts under 512 tokens: recomputed
    finally:
        live_engines.remove(auto)


def test_what_swap_does_not_cover_is_refused(gguf_path, tmp_path):
    with pytest.raises(ValueError, match="swap_space must be a number of GiB > 0"):
        LLM(str(gguf_path), preemption_mode="swap", swap_space=0)
    with pytest.raises(ValueError, match="swap_space .2 GiB. holds the blocks of requests preempted by swap"):
        LLM(str(gguf_path), swap_space=2)  # with recompute it would change nothing
    with pytest.raises(ValueError, match="preemption_mode must be one of recompute, swap, auto"):
        LLM(str(gguf_path), preemption_mode="sometimes")
