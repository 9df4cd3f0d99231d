"""Preemption by swap in the scheduler alone (scheduler/swap_space.py), exact block ids and host
slots: a preempted request's blocks are listed for their copies out and held until the step that
copies them is collected, so the requests preempted for run from the next step on (a step of
copies alone when nobody else runs); it comes back from its slots; an abort while its copies
are in flight frees its blocks only at that step's collection; nothing is left held."""

from __future__ import annotations

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.scheduler import Scheduler, SchedulerOutput
from ember.scheduler.swap_space import SwapSpace


def make(num_blocks: int = 6, num_slots: int = 4) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          preemption_mode="swap")
    return Scheduler(BlockPool(num_blocks), config, swap_space=SwapSpace(num_slots))


def request(rid: str, num_prompt: int, max_tokens: int = 4) -> Request:
    return Request(rid, [100 + i for i in range(num_prompt)], SamplingParams(temperature=0, max_tokens=max_tokens))


def run(s: Scheduler, plan: SchedulerOutput) -> list[tuple[str, int]]:
    """Launch and collect `plan`, a token 7 for each sampling chunk; its chunks as (id, tokens)."""
    s.update(plan, {c.request.request_id: [7] for c in plan.chunks if c.samples})
    s.pool.check_integrity()
    return [(c.request.request_id, c.num_new_tokens) for c in plan.chunks]


def three_running(s: Scheduler) -> tuple[Request, Request, Request]:
    a, b, c = request("a", 8), request("b", 8), request("c", 7)
    for r in (a, b, c):
        s.add_request(r)
    assert run(s, s.schedule()) == [("a", 8), ("b", 8), ("c", 7)]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    return a, b, c


def assert_nothing_held(s: Scheduler) -> None:
    assert not s.has_unfinished() and not s.requests
    assert s.pool.ref_counts == [0] * s.pool.num_blocks and s.pool.num_free == s.pool.num_blocks
    s.swap.new_plan()
    assert sorted(s.swap.free) == list(range(s.swap.num_slots))


def test_swapped_out_blocks_are_held_until_their_step_is_collected_and_the_request_comes_back():
    s = make()
    a, b, c = three_running(s)
    # a's position 8 needs a third block: c, the newest, goes to slots 1, 0. Its blocks stay held while
    # the step copies them out, so neither a nor b (who needs one too) runs in it: a step of copies alone
    plan = s.schedule()
    assert plan.preempted == [c] and plan.swap_outs == [(4, 1), (5, 0)] and plan.blocks_swapping_out == 2
    assert plan.is_empty and plan.has_copies
    assert c.status is RequestStatus.PREEMPTED and c.block_ids == [] and c.swapped == ([1, 0], 7)
    assert plan.free_when_collected == [4, 5] and s.pool.ref_counts[4:] == [1, 1] and s.pool.num_available == 0
    assert s.num_swapped == s.num_preemptions == 1
    s.mark_launched(plan)
    assert s.schedule().is_empty  # in flight: nobody preempts, nothing runs
    assert run(s, plan) == [] and s.pool.num_free == 2
    plan = s.schedule()  # the blocks are back: a and b run, with no other preemption
    assert run(s, plan) == [("a", 1), ("b", 1)] and plan.preempted == [] and not plan.swap_outs
    assert (a.block_ids, b.block_ids) == ([0, 1, 5], [2, 3, 4])
    while a.status is RequestStatus.RUNNING:
        assert run(s, s.schedule()) == [("a", 1), ("b", 1)]
    plan = s.schedule()  # c swaps in: its 7 computed tokens' blocks from slots 1, 0, then its pending token
    assert plan.swap_ins == [(1, 5), (0, 1)] and c.block_ids == [5, 1] and c.swapped is None
    assert run(s, plan) == [("c", 1)]
    while s.has_unfinished():
        assert run(s, s.schedule()) == [("c", 1)]
    assert c.output_token_ids == [7] * 4 and c.num_preemptions == 1
    assert_nothing_held(s)


def test_an_abort_while_its_blocks_are_copied_out_frees_them_when_that_step_is_collected():
    s = make()
    a, b, c = three_running(s)
    plan = s.schedule()
    assert plan.swap_outs == [(4, 1), (5, 0)]
    s.mark_launched(plan)
    assert s.abort("c") == [c] and c.swapped is None and c.finish_reason == "abort"
    assert s.pool.ref_counts[4:] == [1, 1]  # the copies out still read them
    assert s.swap.num_free == 4  # its slots come back at the next schedule
    assert run(s, plan) == [] and s.pool.num_free == 2
    while s.has_unfinished():
        run(s, s.schedule())
    assert a.output_token_ids == b.output_token_ids == [7] * 4
    assert_nothing_held(s)

