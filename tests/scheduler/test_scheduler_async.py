"""The Scheduler's async-scheduling bookkeeping on its own, no model, exact block ids.

The engine drives it as schedule(N+1) -> mark_launched(N+1) -> update(N): a request's token
sampled by a launched step is pending (counted in num_tokens, not yet in
output_token_ids) until its step is updated. Block ids are exact: the pool's free queue
is FIFO and a request's blocks are freed last-first (see test_block_pool.py).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.scheduler import Scheduler, SchedulerOutput

EOS = 2
T = 7  # a plain sampled token
CONFIG = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)


def make_scheduler(num_blocks: int, block_size: int = 4, max_model_len: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), EngineConfig(block_size=block_size, max_num_seqs=8,
                                                         max_num_batched_tokens=64, max_model_len=max_model_len))


def make_request(rid: str, num_prompt: int, max_tokens: int) -> Request:
    prompt = [100 + i for i in range(num_prompt)]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), eos_token_ids=frozenset({EOS}))


def plan_of(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(c.request.request_id, c.num_new_tokens, c.samples) for c in out.chunks]


def schedule_and_launch(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.mark_launched(out)
    return out


def assert_all_free(s: Scheduler) -> None:
    s.pool.check_integrity()
    assert not s.running and not s.waiting and not s.requests and not s.in_flight
    assert s.pool.num_free == s.pool.num_blocks


def test_a_pending_token_is_the_next_step_input_and_the_length_stop_needs_no_extra_step():
    s = make_scheduler(num_blocks=16)
    a = make_request("a", 3, max_tokens=4)
    s.add_request(a)
    p1 = schedule_and_launch(s)
    assert plan_of(p1) == [("a", 3, True)] and a.block_ids == [0]
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_tokens, a.output_token_ids) == (3, 1, 4, [])

    p2 = schedule_and_launch(s)  # step 1 still runs: a's pending token (position 3) is step 2's input
    assert plan_of(p2) == [("a", 1, True)] and a.block_ids == [0]
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_steps_in_flight) == (4, 2, 2)
    assert s.update(p1, {"a": [10]}) == ([a], [])
    assert (a.output_token_ids, a.num_pending_tokens, a.num_tokens) == ([10], 1, 5)

    p3 = schedule_and_launch(s)  # position 4 opens a block
    assert plan_of(p3) == [("a", 1, True)] and a.block_ids == [0, 1]
    s.update(p2, {"a": [11]})
    p4 = schedule_and_launch(s)
    assert plan_of(p4) == [("a", 1, True)]
    s.update(p3, {"a": [12]})
    # 3 known + 1 pending = max_tokens: the pending token ends it, no step is scheduled for it
    assert s.schedule().is_empty
    stepped, finished = s.update(p4, {"a": [13]})
    assert stepped == finished == [a] and a.finish_reason == "length"
    assert a.output_token_ids == [10, 11, 12, 13] and a.num_pending_tokens == a.num_steps_in_flight == 0
    assert_all_free(s)


def test_a_request_that_leaves_while_a_launched_step_computes_for_it_keeps_its_blocks_until_collected():
    s = make_scheduler(num_blocks=16)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 5, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    p1 = schedule_and_launch(s)
    assert (a.block_ids, b.block_ids) == ([0], [1, 2])
    p2 = schedule_and_launch(s)
    assert plan_of(p2) == [("a", 1, True), ("b", 1, True)]

    stepped, finished = s.update(p1, {"a": [EOS], "b": [T]})  # a ends on EOS, but step 2 writes its KV
    assert finished == [a] and a.finish_reason == "stop" and a.block_ids == []
    assert s.pool.ref_counts[0] == 1 and p2.free_when_collected == [0]
    p3 = schedule_and_launch(s)
    assert plan_of(p3) == [("b", 1, True)]
    stepped, finished = s.update(p2, {"a": [T], "b": [T]})
    assert stepped == [b] and finished == []
    assert a.output_token_ids == [EOS]  # the token step 2 sampled for it is dropped
    assert s.pool.ref_counts[0] == 0 and list(s.pool._free)[-1] == 0

    s.abort("b")  # aborted while step 3 computes for it
    assert b.status is RequestStatus.ABORTED and b.block_ids == []
    assert s.pool.ref_counts[1] == s.pool.ref_counts[2] == 1
    assert s.update(p3, {"b": [T]}) == ([], [])
    assert b.output_token_ids == [T, T]
    assert list(s.pool._free)[-2:] == [2, 1]
    assert_all_free(s)


def test_no_preemption_while_a_step_is_in_flight():
    s = make_scheduler(num_blocks=3)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    p1 = schedule_and_launch(s)
    assert (a.block_ids, b.block_ids) == ([0], [1])

    # both pending tokens (position 4) open a block; one is left: a gets it, b is left out
    p2 = schedule_and_launch(s)
    assert plan_of(p2) == [("a", 1, True)] and p2.short_of_blocks and p2.preempted == []
    assert (a.block_ids, b.block_ids) == ([0, 2], [1])
    s.update(p1, {"a": [T], "b": [T]})
    # the engine collects a step that ran short before scheduling again, which may preempt
    s.update(p2, {"a": [T]})
    p3 = s.schedule()
    assert plan_of(p3) == [("a", 1, True)] and p3.preempted == [b] and not p3.short_of_blocks
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.output_token_ids == [T]
    s.update(p3, {"a": [T]})
    for r in (a, b):
        s.abort(r.request_id)
    assert_all_free(s)


def test_a_block_is_cached_once_its_tokens_are_known_and_a_launched_step_computes_them():
    """Cached as soon as the next schedule can use it (the synchronous engine's next
    schedule sees it after the update of the step in flight here); a request that ends
    caches nothing of the token the step after it computed."""
    from ember.scheduler.prefix_cache import RadixPrefixCache

    pool = BlockPool(16)
    s = Scheduler(pool, CONFIG, prefix_cache=RadixPrefixCache(pool, 4))
    a = make_request("a", 3, max_tokens=8)
    s.add_request(a)
    p1 = schedule_and_launch(s)
    p2 = schedule_and_launch(s)  # computes position 3, the pending token: block 0 fills
    assert a.num_blocks_in_cache == 0
    s.update(p1, {"a": [T]})
    assert (a.num_computed_tokens, a.num_known_tokens, a.num_blocks_in_cache) == (4, 4, 1) and pool.cached[0]
    p3 = schedule_and_launch(s)  # position 4 opens block 1
    assert a.block_ids == [0, 1]
    s.update(p2, {"a": [EOS]})  # ends: step 3 computes position 4 for nothing
    assert a.finish_reason == "stop" and a.num_blocks_in_cache == 1 and not pool.cached[1]
    assert p3.free_when_collected == [0, 1]  # step 3 still computes with both
    s.update(p3, {"a": [T]})
    assert pool.num_in_use == 0 and pool.num_evictable == 1 and list(pool._free)[-1] == 1
    pool.check_integrity()


def test_a_block_the_prefix_cache_swaps_out_is_freed_once_the_launched_step_that_writes_it_is_collected():
    from ember.scheduler.prefix_cache import RadixPrefixCache

    pool = BlockPool(16)
    s = Scheduler(pool, CONFIG, prefix_cache=RadixPrefixCache(pool, 4))
    # the same one-block prompt: no later request could take its block from the cache (the last
    # token is always computed), so b is not deferred to wait for a's copy
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    p1 = s.schedule()  # both prefilled in one step: blocks 0 and 1 get the same KV
    assert (a.block_ids, b.block_ids) == ([0], [1])
    s.mark_launched(p1)  # block 0 enters the cache; b takes it for its copy, which step 1 still writes
    assert (a.block_ids, b.block_ids) == ([0], [0])
    assert pool.ref_counts[0] == 2 and pool.ref_counts[1] == 1 and p1.free_when_collected == [1]
    p2 = schedule_and_launch(s)
    s.update(p1, {"a": [T], "b": [T]})
    assert pool.ref_counts[1] == 0 and list(pool._free)[-1] == 1
    s.update(p2, {"a": [T], "b": [T]})
    for r in (a, b):
        s.abort(r.request_id)
    pool.check_integrity()
    assert pool.num_in_use == 0


def drive(async_: bool, arrivals: dict[int, list[Request]], token, budget: int = 64) -> list:
    """Run a scheduler with a prefix cache to the end, synchronously (schedule, update) or
    as the async engine does (schedule N+1, launched, update N); `token(req)` is the id
    sampled for req's next position. Returns each step's plan as (id, tokens, block table)
    and the prefix-cache hits."""
    from ember.scheduler.prefix_cache import RadixPrefixCache

    pool = BlockPool(64)
    config = dataclasses.replace(CONFIG, max_num_batched_tokens=budget)
    s = Scheduler(pool, config, prefix_cache=RadixPrefixCache(pool, 4))
    plans, launched, k = [], [], 0
    while k <= max(arrivals) or s.has_unfinished() or launched:
        for r in arrivals.get(k, []):
            s.add_request(r)
        k += 1
        out = s.schedule()
        if not out.is_empty:
            plans.append([(c.request.request_id, c.num_new_tokens, list(c.request.block_ids)) for c in out.chunks])
            s.mark_launched(out)
            launched.append(out)
        while len(launched) > (1 if async_ else 0) or (launched and out.is_empty):
            done = launched.pop(0)
            s.update(done, {c.request.request_id: [token(c.request)] for c in done.chunks if c.samples})
    pool.check_integrity()
    return plans, s.prefix_cache_hits


def test_each_step_sees_the_blocks_and_cache_of_the_synchronous_schedule():
    """The same steps with the same block tables as the synchronous scheduler: blocks are
    cached (and swapped for the cache's copy) in time for the step a synchronous engine
    would first use them in, though the async one is scheduled before the previous update."""
    def token(req: Request) -> int:  # the same prompt gives the same tokens: b's blocks duplicate a's
        return 200 + (sum(req.prompt_token_ids) + req.num_known_tokens) % 50

    def arrivals():
        same = [100 + i for i in range(6)]
        return {0: [Request("a", same, SamplingParams(temperature=0, max_tokens=12)),
                    Request("c", [300 + i for i in range(21)], SamplingParams(temperature=0, max_tokens=5))],
                2: [Request("b", same, SamplingParams(temperature=0, max_tokens=12))],
                4: [Request("d", same + [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))]}

    sync_plans, sync_hits = drive(False, arrivals(), token, budget=8)
    async_plans, async_hits = drive(True, arrivals(), token, budget=8)
    assert async_plans == sync_plans and async_hits == sync_hits > 0
    assert any(len(p) > 1 and p[0][2][0] == p[1][2][0] for p in sync_plans[4:])  # swapped blocks were shared


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_give_the_synchronous_plans(seed):
    """Prompts sharing prefixes, chunked prefills, max_tokens from 1, arrivals over time,
    no EOS and a pool that never runs short: the async plans are the synchronous ones."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, 200) for _ in range(rng.randrange(1, 12))] for _ in range(3)]

    def token(req: Request) -> int:
        return 200 + (sum(req.all_token_ids) * 31 + req.num_known_tokens) % 97

    def arrivals():
        rng2 = random.Random(seed)
        out: dict[int, list[Request]] = {}
        for i in range(10):
            prompt = rng2.choice(stems) + [rng2.randrange(100, 200) for _ in range(rng2.randrange(1, 10))]
            out.setdefault(rng2.randrange(0, 8), []).append(
                Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng2.randrange(1, 14))))
        return out

    budget = [8, 16, 64][seed % 3]
    sync_plans, sync_hits = drive(False, arrivals(), token, budget)
    async_plans, async_hits = drive(True, arrivals(), token, budget)
    assert async_plans == sync_plans and async_hits == sync_hits
