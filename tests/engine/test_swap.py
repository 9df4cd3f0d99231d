"""Preemption by swap (--preemption-mode swap / auto, --swap-space; scheduler/swap_space.py) on
the default model's batch-invariant path: a pool too small for the batch preempts, the preempted
requests' blocks go to host slots and come back, and every token and logprob is the run's with a
pool big enough (float32 too, through requests swapped out and back twice); an abort while
swapped out, or while its step of copies out is still in flight (async scheduling), gives its
slots and blocks back; auto recomputes short contexts."""

from __future__ import annotations

import pytest
import torch
from engine_steps import abort_one_when
from invariance import assert_same, results
from sampling import greedy

from ember import LLM
from ember.engine.core import EngineCore
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


# float32, dequantized (extra_llm): four requests that grow to 8 blocks of 8 in a pool of 12, some
# swapped out and back twice. Deterministic: the dense float32 matmuls' bits follow the row count
# otherwise (oneDNN on an AVX-512 CPU), and preemption changes what shares a step
INVARIANT = dict(max_model_len=96, block_size=8, deterministic=True)
FP32 = dict(num_kv_blocks=12, preemption_mode="swap", swap_space=0.01, **INVARIANT)
FP32_TOKENS = 40


def fp32_requests(llm: LLM, tag: str) -> list[Request]:
    return [Request(f"{tag}-{i}", p["prompt_token_ids"][:20], greedy(FP32_TOKENS, ignore_eos=True, logprobs=0))
            for i, p in enumerate(prompts(llm) + prompts(llm)[:1])]


@pytest.fixture(scope="module")
def fp32_want(extra_llm) -> tuple[LLM, list[tuple[list[int], list[float]]]]:
    big = extra_llm(num_kv_blocks=64, **INVARIANT)
    reqs = fp32_requests(big, "want")
    want = results(big.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                                greedy(FP32_TOKENS, ignore_eos=True, logprobs=0)))
    return big, want


def run_requests(core: EngineCore, reqs: list[Request], abort_when=None) -> dict[str, tuple[list[int], list[float]]]:
    """Each request's tokens and their logprobs, from the engine's step outputs; `abort_when(core)`:
    the request to abort after a step, or None."""
    got: dict[str, tuple[list[int], list[float]]] = {r.request_id: ([], []) for r in reqs}
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id in got:
                got[out.request_id][0].extend(out.new_token_ids)
                got[out.request_id][1].extend(lp.logprob for lp in out.logprobs or [])
        gone = abort_when(core) if abort_when is not None else None
        if gone is not None:
            core.abort_request(gone.request_id)
            abort_when = None
    return got


def test_float32_requests_swapped_out_and_back_twice_give_a_big_pools_tokens_bit_for_bit(extra_llm, fp32_want):
    _, want = fp32_want
    swap = extra_llm(**FP32)
    reqs = fp32_requests(swap, "twice")
    got = run_requests(swap.engine, reqs)
    assert_same([got[r.request_id] for r in reqs], want, "swap, float32")
    sched = swap.engine.scheduler
    assert max(r.num_preemptions for r in reqs) >= 2  # preempted, resumed, preempted again
    assert sched.num_swapped == sched.num_preemptions
    assert sched.swap.num_free == sched.swap.num_slots
    swap.engine.check_idle()


def test_an_abort_while_its_copies_out_are_in_flight_frees_its_blocks_at_their_collection(extra_llm, fp32_want):
    _, want = fp32_want
    swap = extra_llm(**FP32, async_scheduling=True)
    core, sched = swap.engine, swap.engine.scheduler
    reqs = fp32_requests(swap, "mid")
    seen = []

    def swapping_out(core: EngineCore) -> Request | None:
        plan = sched.in_flight[-1] if sched.in_flight else None
        if plan is None or not plan.swap_outs:
            return None
        gone = next(r for r in reqs if r.swapped is not None and set(r.swapped[0]) <= {s for _, s in plan.swap_outs})
        # launched, not collected: the blocks it copies out are still held, the request holds none
        blocks = [b for b, _ in plan.swap_outs]
        assert gone.block_ids == [] and set(blocks) <= set(plan.free_when_collected)
        assert all(sched.pool.ref_counts[b] > 0 for b in blocks)
        seen.append(gone)
        return gone

    got = run_requests(core, reqs, swapping_out)
    gone = seen[0]
    assert gone.finish_reason == "abort" and gone.swapped is None
    assert_same([got[r.request_id] for r in reqs if r is not gone],
                [w for r, w in zip(reqs, want) if r is not gone], "swap, async, an abort mid-swap")
    assert sched.swap.num_free == sched.swap.num_slots
    core.check_idle()



def test_a_draft_models_cache_is_swapped_with_the_targets(gguf_path, live_engines, engines):
    """The default model drafting for itself: a swapped-out request's KV comes back, the draft
    model's own cache as the target's (runner/kv_copies.py), at whatever blocks it resumes in;
    its tokens and logprobs are a big pool's."""
    big, _ = engines
    spec = LLM(str(gguf_path), **SMALL, preemption_mode="swap", swap_space=0.01,
               speculative_config={"model": str(gguf_path), "num_speculative_tokens": 3})
    live_engines.append(spec)
    try:
        core, runner = spec.engine, spec.engine.runner
        params = greedy(30, ignore_eos=True, logprobs=0)
        reqs = [Request(f"draft-{i}", p["prompt_token_ids"], params) for i, p in enumerate(prompts(spec))]

        def kv(req: Request, computed: int) -> list:
            """Its computed positions' KV in the target's cache and the drafter's."""
            blocks = req.block_ids[:core.scheduler.blocks_for(computed)]
            return [c[:, :, blocks].flatten(2, 3)[:, :, :computed].clone() for c in runner.kv_caches()]

        saved, compared = {}, 0
        for r in reqs:
            core.add_request(r)
        while core.has_unfinished_requests():
            before = {r.request_id: (r.swapped, r.block_ids, r.num_computed_tokens) for r in reqs}
            held = {r.request_id: kv(r, r.num_computed_tokens) for r in reqs if r.block_ids}
            core.step()
            for r in reqs:
                swapped, blocks, computed = before[r.request_id]
                if swapped is None and r.swapped is not None:  # swapped out in this step: what it held
                    saved[r.request_id] = r.swapped[1], held[r.request_id]
                elif swapped is not None and r.swapped is None:  # back in this step
                    computed, want = saved.pop(r.request_id)
                    assert all(torch.equal(g, w) for g, w in zip(kv(r, computed), want))
                    compared += 1
        assert compared > 0 and len(runner.kv_caches()) == 2
        assert [r.output_token_ids for r in reqs] == [list(o.outputs[0].token_ids)
                                                      for o in big.generate(prompts(big), params)]
        sched = core.scheduler
        assert sched.num_swapped > 0 and sched.num_swapped == sched.num_preemptions
        assert sched.spec.num_accepted_tokens / sched.spec.num_draft_tokens > 0.8
        assert sched.swap.num_free == sched.swap.num_slots
        core.check_idle()
    finally:
        live_engines.remove(spec)
