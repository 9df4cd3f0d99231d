"""The Scheduler on its own, no model: fake prompt token ids, hand-picked sampled tokens.

Each test drives `schedule()` then `update(out, sampled)` the way EngineCore.step does,
with a sampled token for exactly the chunks that reach the end of their request's tokens
(`ScheduledChunk.samples`, fixed when the chunk is scheduled).
Block ids are exact: the pool's free queue is FIFO and a request's blocks are freed
last-first (see test_block_pool.py).

After every step `step()` checks the invariants (budget, max_num_seqs, token counts,
block ownership, pool integrity); after every scenario the pool is entirely free.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

EOS = 2
TOKEN = 7  # a plain sampled token: not EOS, not a stop id


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 256) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                                                         max_num_batched_tokens=max_num_batched_tokens,
                                                         max_model_len=max_model_len))


def make_request(rid: str, num_prompt: int, max_tokens: int | None = 4, **params) -> Request:
    prompt = [100 + (i % 50) for i in range(num_prompt)]
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}))


def check_invariants(s: Scheduler, out: SchedulerOutput | None = None) -> None:
    s.pool.check_integrity()
    if out is not None:
        assert out.num_tokens <= s.max_num_batched_tokens
        assert len(out.chunks) <= s.max_num_seqs
        assert all(c.num_new_tokens > 0 for c in out.chunks)
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}"
        assert not {r.request_id for r in out.preempted} & set(ids)
    assert len(s.running) <= s.max_num_seqs
    # between schedule() and update() a scheduled request already holds the blocks of its chunk
    pending = {c.request.request_id: c.num_new_tokens for c in out.chunks} if out is not None else {}
    drafts = {c.request.request_id: len(c.draft_token_ids) for c in out.chunks} if out is not None else {}
    held = []
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
        assert 0 <= r.num_computed_tokens <= r.num_tokens <= s.max_model_len
        # exactly the blocks its computed (and scheduled) tokens need, drafts included: no more, no fewer
        need = r.num_computed_tokens + pending.get(r.request_id, 0)
        assert need <= r.num_tokens + drafts.get(r.request_id, 0)
        assert len(r.block_ids) == s.blocks_for(need), (r.request_id, r.block_ids, need)
        held += r.block_ids
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == [] and r.num_computed_tokens == 0
    assert len(held) == len(set(held)), "two requests hold the same block"
    assert sorted(held) == sorted(b for b, rc in enumerate(s.pool.ref_counts) if rc > 0)
    assert set(s.requests) == {r.request_id for r in [*s.running, *s.waiting]}


def step(s: Scheduler, sample: Callable[[Request], int] | dict[str, int] | None = None):
    """One schedule + update; returns (the plan as [(id, n, samples)], the plan, finished)."""
    out = s.schedule()
    check_invariants(s, out)
    plan = [(c.request.request_id, c.num_new_tokens, c.samples) for c in out.chunks]
    sampled = {}
    for c in out.chunks:
        if c.samples:
            rid = c.request.request_id
            if sample is None:
                token = TOKEN
            elif isinstance(sample, dict):
                token = sample.get(rid, TOKEN)
            else:
                token = sample(c.request)
            sampled[rid] = [token]  # n == 1: one token per sampling request
    stepped, finished = s.update(out, sampled)
    assert [r.request_id for r in stepped] == [rid for rid, _, samples in plan if samples]
    check_invariants(s)
    for r in finished:
        assert r.status is RequestStatus.FINISHED and r.block_ids == []
    return plan, out, finished


def run_to_end(s: Scheduler, sample=None, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_unfinished():
        step(s, sample)
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    assert_all_free(s)
    return steps


def assert_all_free(s: Scheduler) -> None:
    s.pool.check_integrity()
    assert not s.running and not s.waiting and not s.requests
    assert s.pool.num_free == s.pool.num_blocks
    assert s.pool.ref_counts == [0] * s.pool.num_blocks


# ---- the step's limits, on random workloads ------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_respect_budget_and_max_num_seqs(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([32, 64, 128])
    num_blocks = rng.randint(max_model_len // block_size + 1, 4 * max_model_len // block_size)
    s = make_scheduler(num_blocks, block_size, max_num_seqs=rng.randint(1, 6),
                       max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64]), max_model_len=max_model_len)
    expected: dict[str, int] = {}
    finished: list[Request] = []
    pending = 40
    max_in_step = 0
    steps = 0
    while pending or s.has_unfinished():
        for _ in range(rng.randint(0, 3) if pending else 0):
            prompt = rng.randint(1, max_model_len - 1)
            max_tokens = rng.choice([None, 1, 2, rng.randint(1, 40)])
            req = make_request(f"r{pending}", prompt, max_tokens=max_tokens)
            s.add_request(req)
            limit = max_model_len - prompt
            expected[req.request_id] = limit if max_tokens is None else min(max_tokens, limit)
            pending -= 1
            if not pending:
                break
        if s.has_unfinished():
            _, out, done = step(s)
            assert not out.is_empty or out.preempted, "a step with work to do scheduled nothing"
            max_in_step = max(max_in_step, out.num_tokens)
            finished += done
        steps += 1
        assert steps < 20_000
    assert_all_free(s)
    assert len(finished) == 40
    for r in finished:
        assert len(r.output_token_ids) == expected[r.request_id], r.request_id
        assert r.finish_reason == "length"
        assert r.num_tokens <= s.max_model_len
    assert max_in_step <= s.max_num_batched_tokens


# ---- chunked prefill, mixed steps, exact block ids ----------------------------------------

def test_a_long_prompt_is_prefilled_in_chunks_and_samples_on_the_last():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    a = make_request("a", 40, max_tokens=2)
    s.add_request(a)
    plan, out, _ = step(s)
    assert plan == [("a", 16, False)]
    assert a.block_ids == [0, 1, 2, 3]
    assert (a.num_computed_tokens, a.output_token_ids) == (16, [])
    plan, _, _ = step(s)
    assert plan == [("a", 16, False)]
    assert a.block_ids == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (a.num_computed_tokens, a.output_token_ids) == (32, [])
    plan, _, _ = step(s)
    assert plan == [("a", 8, True)]
    assert a.block_ids == list(range(10))
    assert (a.num_computed_tokens, a.num_tokens, a.output_token_ids) == (40, 41, [TOKEN])
    plan, _, done = step(s)
    assert plan == [("a", 1, True)]  # position 40 opens block 10
    assert done == [a] and a.finish_reason == "length"
    assert a.output_token_ids == [TOKEN, TOKEN]
    assert_all_free(s)


def test_with_an_attention_parity_len_chunks_shrink_as_the_context_grows():
    """CPU: a chunk starting at context c gets at most budget * L / (L + c) tokens (L = 16
    here), so each step costs about as much as the first; decodes are never cut."""
    s = Scheduler(BlockPool(64), EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256,
                                              attention_parity_len=16))
    a, b = make_request("a", 60, max_tokens=2), make_request("b", 3, max_tokens=3)
    s.add_request(a)
    chunks = []
    while a.num_computed_tokens < a.num_prompt_tokens:
        plan, _, _ = step(s)
        chunks += [n for rid, n, _ in plan if rid == "a"]
    assert chunks == [16, 8, 6, 5, 5, 4, 4, 4, 3, 3, 2]  # 16 * 16 // (16 + c), the last what is left
    assert sum(chunks) == 60
    s.add_request(b)
    plan, _, _ = step(s)
    assert plan == [("a", 1, True), ("b", 3, True)]  # b's prompt at context 0 is whole
    while s.has_unfinished():
        step(s)
    assert_all_free(s)


def test_samples_is_fixed_when_the_chunk_is_scheduled():
    """`ScheduledChunk.samples` is set from the request's counters when the plan is made:
    it still describes the step after `launched`/`update` advanced num_computed_tokens
    (with async scheduling a plan is updated after the next one is scheduled)."""
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", 5, max_tokens=3))
    out = s.schedule()
    assert out.chunks[0].samples
    s.update(out, {"a": [TOKEN]})
    assert out.chunks[0].samples and not ScheduledChunk(out.chunks[0].request, 5).samples
    run_to_end(s)


def test_a_step_mixes_decodes_and_a_prefill_chunk_with_exact_blocks():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    b, c, a = make_request("b", 6, max_tokens=5), make_request("c", 3, max_tokens=5), make_request("a", 40, max_tokens=2)
    s.add_request(b)
    s.add_request(c)

    plan, _, _ = step(s)  # both prompts in one step
    assert plan == [("b", 6, True), ("c", 3, True)]
    assert (b.block_ids, c.block_ids) == ([0, 1], [2])

    s.add_request(a)
    plan, _, _ = step(s)  # 2 decodes first, then a's prompt takes the 14 tokens left
    assert plan == [("b", 1, True), ("c", 1, True), ("a", 14, False)]
    assert (b.block_ids, c.block_ids, a.block_ids) == ([0, 1], [2], [3, 4, 5, 6])

    plan, _, _ = step(s)  # c's position 4 opens a block; a reaches 28 tokens
    assert plan == [("b", 1, True), ("c", 1, True), ("a", 14, False)]
    assert (b.block_ids, c.block_ids, a.block_ids) == ([0, 1], [2, 7], [3, 4, 5, 6, 8, 9, 10])

    plan, _, _ = step(s)  # b's position 8 opens a block; a's last 12 prompt tokens, sampled
    assert plan == [("b", 1, True), ("c", 1, True), ("a", 12, True)]
    assert b.block_ids == [0, 1, 11]
    assert c.block_ids == [2, 7]
    assert a.block_ids == [3, 4, 5, 6, 8, 9, 10, 12, 13, 14]
    assert a.output_token_ids == [TOKEN]

    plan, _, done = step(s)  # a's position 40 opens block 15; b and c finish (5 tokens each), a (2)
    assert plan == [("b", 1, True), ("c", 1, True), ("a", 1, True)]
    assert a.output_token_ids == [TOKEN, TOKEN]
    assert [r.request_id for r in done] == ["b", "c", "a"]
    assert_all_free(s)
    # freed in finishing order, each request tail-first, behind the never-used blocks
    assert list(s.pool._free)[:16] == list(range(16, 32))
    assert list(s.pool._free)[16:] == [11, 1, 0, 7, 2, 15, 14, 13, 12, 10, 9, 8, 6, 5, 4, 3]


# ---- order: running before waiting, waiting FCFS ----------------------------------------

def test_running_requests_come_before_waiting_ones_and_waiting_is_fcfs():
    s = make_scheduler(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = {rid: make_request(rid, n, max_tokens=m)
            for rid, n, m in [("a", 5, 1), ("b", 3, 3), ("c", 9, 2), ("d", 2, 2), ("e", 4, 1)]}
    for r in reqs.values():
        s.add_request(r)
    plan, _, done = step(s)
    assert plan == [("a", 5, True), ("b", 3, True)]  # max_num_seqs 2: c, d, e wait
    assert [r.request_id for r in done] == ["a"]
    assert [r.request_id for r in s.waiting] == ["c", "d", "e"]
    plan, _, done = step(s)
    assert plan == [("b", 1, True), ("c", 9, True)]  # running b first, then the oldest waiting
    assert done == []
    plan, _, done = step(s)
    assert plan == [("b", 1, True), ("c", 1, True)]
    assert [r.request_id for r in done] == ["b", "c"]
    plan, _, done = step(s)
    assert plan == [("d", 2, True), ("e", 4, True)]
    assert [r.request_id for r in done] == ["e"]
    plan, _, done = step(s)
    assert plan == [("d", 1, True)]
    assert_all_free(s)


def test_the_waiting_head_blocks_later_requests_that_would_fit():
    """Strict FCFS: a small request does not overtake a waiting head that does not fit."""
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a, big, small = make_request("a", 12, 3), make_request("big", 16, 2), make_request("small", 2, 1)
    s.add_request(a)
    step(s)
    assert a.block_ids == [0, 1, 2]
    s.add_request(big)
    s.add_request(small)
    plan, _, _ = step(s)  # big needs 4 blocks, 3 are free: nobody is admitted behind it
    assert plan == [("a", 1, True)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    assert a.block_ids == [0, 1, 2, 3]
    plan, _, done = step(s)
    assert plan == [("a", 1, True)] and done == [a]
    plan, _, _ = step(s)
    assert plan == [("big", 16, True), ("small", 2, True)]
    run_to_end(s)


def test_the_budget_limits_admission_and_chunks_the_next_waiting_request():
    s = make_scheduler(max_num_batched_tokens=10)
    for rid, n in [("a", 4), ("b", 4), ("c", 4)]:
        s.add_request(make_request(rid, n, max_tokens=2))
    plan, _, _ = step(s)
    assert plan == [("a", 4, True), ("b", 4, True), ("c", 2, False)]
    plan, _, _ = step(s)
    assert plan == [("a", 1, True), ("b", 1, True), ("c", 2, True)]
    run_to_end(s)


# ---- preemption ----------------------------------------------------------------------------

def test_out_of_blocks_the_newest_running_request_is_preempted_and_comes_back():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a, b, c = make_request("a", 8, 4), make_request("b", 8, 4), make_request("c", 7, 4)
    for r in (a, b, c):
        s.add_request(r)
    sample = {"a": 11, "b": 12, "c": 13}

    plan, _, _ = step(s, sample)
    assert plan == [("a", 8, True), ("b", 8, True), ("c", 7, True)]
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1], [2, 3], [4, 5])
    assert s.pool.num_free == 0

    # a's position 8 needs a third block: c, the newest, is preempted (tail-first: 5, 4)
    plan, out, _ = step(s, sample)
    assert out.preempted == [c]
    assert plan == [("a", 1, True), ("b", 1, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1, 5], [2, 3, 4])
    assert c.status is RequestStatus.PREEMPTED
    assert c.block_ids == [] and c.num_computed_tokens == 0
    assert c.output_token_ids == [13]  # its sampled token is kept and recomputed later
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert (s.num_preemptions, c.num_preemptions, a.num_preemptions) == (1, 1, 0)

    plan, out, _ = step(s, sample)  # c does not fit yet
    assert plan == [("a", 1, True), ("b", 1, True)] and out.preempted == []
    plan, _, done = step(s, sample)
    assert done == [a, b]
    assert s.pool.num_free == 6
    assert list(s.pool._free) == [5, 1, 0, 4, 3, 2]

    plan, _, _ = step(s, sample)  # c is recomputed: 7 prompt tokens + its 1 output token
    assert plan == [("c", 8, True)]
    assert c.status is RequestStatus.RUNNING
    assert c.block_ids == [5, 1]
    assert c.output_token_ids == [13, 13]
    plan, _, _ = step(s, sample)
    assert plan == [("c", 1, True)] and c.block_ids == [5, 1, 0]
    plan, _, done = step(s, sample)
    assert done == [c] and c.finish_reason == "length"
    assert c.output_token_ids == [13] * 4
    assert a.output_token_ids == [11] * 4 and b.output_token_ids == [12] * 4
    assert_all_free(s)


def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    a, b, w = make_request("a", 8, 3), make_request("b", 8, 3), make_request("w", 1, 1)
    for r in (a, b, w):
        s.add_request(r)
    plan, _, _ = step(s)
    assert plan == [("a", 8, True), ("b", 8, True)]
    assert [r.request_id for r in s.waiting] == ["w"]
    plan, out, _ = step(s)
    assert out.preempted == [b]
    assert plan == [("a", 1, True)]
    assert [r.request_id for r in s.waiting] == ["b", "w"]
    run_to_end(s)
    assert s.num_preemptions == 1


def test_the_newest_request_preempts_itself_when_it_needs_a_block():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = make_request("a", 6, 2), make_request("b", 8, 3)
    s.add_request(a)
    s.add_request(b)
    plan, _, _ = step(s)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    plan, out, done = step(s)  # a fits in its blocks; b (newest) needs a third: it yields itself
    assert plan == [("a", 1, True)]
    assert out.preempted == [b] and done == [a]
    assert b.status is RequestStatus.PREEMPTED and list(s.waiting) == [b]
    # b's blocks went back first (in schedule: 3, 2), then a's (in update: 1, 0)
    assert list(s.pool._free) == [3, 2, 1, 0]
    plan, _, _ = step(s)
    assert plan == [("b", 9, True)]
    assert b.block_ids == [3, 2, 1]
    run_to_end(s)
    assert s.num_preemptions == 1


def test_under_sustained_pressure_requests_are_preempted_again_and_all_finish():
    """12 requests of up to 7 blocks share 8 blocks: many preemptions, every request ends
    with exactly its max_tokens tokens, and the pool is entirely free at the end."""
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=6, max_num_batched_tokens=16, max_model_len=64)
    reqs = [make_request(f"r{i}", 5 + i, max_tokens=12) for i in range(12)]
    for r in reqs:
        s.add_request(r)
    run_to_end(s)
    assert s.num_preemptions >= 5
    assert s.num_preemptions == sum(r.num_preemptions for r in reqs)
    assert max(r.num_preemptions for r in reqs) >= 2
    assert all(r.output_token_ids == [TOKEN] * 12 and r.finish_reason == "length" for r in reqs)


def test_priority_preemption_never_takes_a_request_already_in_the_plan():
    s = Scheduler(BlockPool(4), EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                             scheduling_policy="priority"))
    low = Request("low", [100] * 6, SamplingParams(temperature=0, max_tokens=8), priority=5)
    s.add_request(low)
    step(s)  # low: blocks [0, 1], 7 tokens
    high = Request("high", [100] * 8, SamplingParams(temperature=0, max_tokens=4), priority=0)
    s.add_request(high)
    step(s)  # low decodes in its 2 blocks; high is admitted with [2, 3]: the pool is full
    assert s.running == [low, high] and s.pool.num_free == 0
    out = s.schedule()  # low's position 7 fits; high's position 8 needs a block: low is the victim
    assert out.preempted == [low]
    scheduled = [c.request for c in out.chunks]
    assert low not in scheduled, "a preempted request is still in the plan, with no blocks"
    assert scheduled == [high]


# ---- add_request ---------------------------------------------------------------------------

def test_add_request_refuses_a_request_that_never_fits_the_pool():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError) as err:
        s.add_request(make_request("big", 10, max_tokens=8))
    msg = str(err.value)
    assert "'big'" in msg and "18 tokens" in msg and "needs 5 blocks" in msg and "has 4" in msg
    assert "max_tokens" in msg
    assert not s.requests and not s.waiting
    s.add_request(make_request("ok", 10, max_tokens=7))  # 17 tokens, KV for 16: 4 blocks
    run_to_end(s)


def test_add_request_with_no_max_tokens_counts_up_to_max_model_len():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="may grow to 32 tokens, whose KV needs 8 blocks, but the whole pool has 4"):
        s.add_request(make_request("x", 3, max_tokens=None))
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=32)
    s.add_request(make_request("x", 3, max_tokens=None))
    run_to_end(s)


def test_add_request_accepts_a_request_whose_kv_exactly_fits():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    req = make_request("edge", 8, max_tokens=9)
    s.add_request(req)
    run_to_end(s)
    assert len(req.output_token_ids) == 9


def test_the_kv_of_prompt_plus_max_tokens_minus_one_is_all_a_request_uses():
    """8 + 9 tokens finish holding 4 blocks of 4: the last token never gets KV."""
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    req = make_request("edge", 8, max_tokens=9)
    s.add_request(req)
    most = 0
    while s.has_unfinished():
        step(s)
        most = max(most, len(req.block_ids))
    assert most == 4 and len(req.output_token_ids) == 9
    assert_all_free(s)


@pytest.mark.parametrize("num_prompt", [12, 20])
def test_add_request_refuses_a_prompt_with_no_room_for_output(num_prompt):
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=12)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("long", num_prompt, max_tokens=4))


def test_add_request_refuses_a_duplicate_id():
    s = make_scheduler()
    first = make_request("same", 4, 2)
    s.add_request(first)
    with pytest.raises(ValueError, match="'same' is already in use"):
        s.add_request(make_request("same", 6, 2))
    assert list(s.waiting) == [first] and s.requests == {"same": first}
    step(s)
    with pytest.raises(ValueError, match="already in use"):  # running too
        s.add_request(make_request("same", 6, 2))
    run_to_end(s)
    s.add_request(make_request("same", 6, 2))  # once finished, the id is free again
    run_to_end(s)


# ---- abort ---------------------------------------------------------------------------------

def test_abort_frees_all_blocks_at_once_from_running_and_waiting():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, w = make_request("a", 10, 8), make_request("b", 5, 8), make_request("w", 3, 8)
    for r in (a, b, w):
        s.add_request(r)
    step(s)
    step(s)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3, 4])
    assert list(s.waiting) == [w]

    assert s.abort("a") == [a]
    check_invariants(s)
    assert a.status is RequestStatus.ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and s.running == [b]
    assert list(s.pool._free)[-3:] == [2, 1, 0]
    assert s.pool.num_free == 16 - 2

    assert s.abort("w") == [w]  # waiting: holds no block, leaves the queue
    assert w.status is RequestStatus.ABORTED and not s.waiting
    check_invariants(s)

    assert s.abort("b") == [b]
    assert s.abort("b") == []  # already gone
    assert s.abort("nope") == []
    assert_all_free(s)
    assert s.schedule().is_empty


def test_abort_a_preempted_request():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = make_request("a", 8, 3), make_request("b", 8, 3)
    s.add_request(a)
    s.add_request(b)
    step(s)
    _, out, _ = step(s)
    assert out.preempted == [b]
    assert s.abort("b") == [b]
    assert b.status is RequestStatus.ABORTED and not s.waiting
    check_invariants(s)
    assert s.abort("a") == [a]
    assert_all_free(s)


def test_abort_mid_chunked_prefill():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a = make_request("a", 30, 4)
    s.add_request(a)
    step(s)
    step(s)
    assert a.num_computed_tokens == 16 and a.block_ids == [0, 1, 2, 3]
    s.abort("a")
    assert_all_free(s)


# ---- finish reasons ------------------------------------------------------------------------

def run_one(req: Request, tokens: list[int], **sched) -> Scheduler:
    """Run `req` alone, sampling `tokens` in order."""
    s = make_scheduler(**sched)
    s.add_request(req)
    it = iter(tokens)
    run_to_end(s, lambda r: next(it))
    return s


def test_max_tokens_finishes_with_length():
    req = make_request("r", 5, max_tokens=3)
    run_one(req, [7, 8, 9, 10])
    assert req.output_token_ids == [7, 8, 9]
    assert (req.finish_reason, req.stop_reason, req.status) == ("length", None, RequestStatus.FINISHED)
    assert req.finish_time is not None


def test_eos_finishes_with_stop_and_keeps_the_eos_token():
    req = make_request("r", 5, max_tokens=10)
    run_one(req, [7, 8, EOS, 9])
    assert req.output_token_ids == [7, 8, EOS]
    assert (req.finish_reason, req.stop_reason) == ("stop", None)


def test_eos_is_any_of_the_request_eos_ids():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=frozenset({2, 99}))
    run_one(req, [7, 99, 8])
    assert req.output_token_ids == [7, 99] and req.finish_reason == "stop"


def test_ignore_eos_runs_past_eos():
    req = make_request("r", 5, max_tokens=4, ignore_eos=True)
    run_one(req, [EOS, EOS, 8, EOS, 9])
    assert req.output_token_ids == [EOS, EOS, 8, EOS]
    assert req.finish_reason == "length"


def test_min_tokens_holds_eos_back():
    req = make_request("r", 5, max_tokens=10, min_tokens=3)
    run_one(req, [EOS, EOS, EOS, 8])
    assert req.output_token_ids == [EOS, EOS, EOS]  # the third EOS is the first that counts
    assert req.finish_reason == "stop"
    req = make_request("r", 5, max_tokens=10, min_tokens=3)
    run_one(req, [EOS, EOS, 8, EOS, 9])
    assert req.output_token_ids == [EOS, EOS, 8, EOS]


def test_stop_token_ids_finish_with_the_id_as_stop_reason():
    req = make_request("r", 5, max_tokens=10, stop_token_ids=[42, 43])
    run_one(req, [7, 43, 8])
    assert req.output_token_ids == [7, 43]
    assert (req.finish_reason, req.stop_reason) == ("stop", 43)


def test_min_tokens_holds_stop_token_ids_back_too():
    req = make_request("r", 5, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    run_one(req, [42, 42, 8])
    assert req.output_token_ids == [42, 42]
    assert (req.finish_reason, req.stop_reason) == ("stop", 42)


def test_stop_token_id_with_ignore_eos_still_stops():
    req = make_request("r", 5, max_tokens=10, ignore_eos=True, stop_token_ids=[EOS])
    run_one(req, [7, EOS, 8])
    assert (req.output_token_ids, req.finish_reason, req.stop_reason) == ([7, EOS], "stop", EOS)


def test_eos_on_the_last_allowed_token_is_stop_not_length():
    req = make_request("r", 5, max_tokens=2)
    run_one(req, [7, EOS])
    assert (req.finish_reason, req.stop_reason) == ("stop", None)


def test_reaching_max_model_len_finishes_with_length():
    req = make_request("r", 8, max_tokens=None)
    s = run_one(req, [7] * 20, max_model_len=12)
    assert req.output_token_ids == [7] * 4
    assert req.num_tokens == s.max_model_len == 12
    assert req.finish_reason == "length"
    req = make_request("r", 8, max_tokens=100)  # max_tokens past the context: the context wins
    run_one(req, [7] * 20, max_model_len=12)
    assert (len(req.output_token_ids), req.finish_reason) == (4, "length")


def test_finished_requests_leave_the_scheduler_and_finish_in_one_step():
    s = make_scheduler(num_blocks=16)
    a, b, c = make_request("a", 3, 5), make_request("b", 4, 5, stop_token_ids=[42]), make_request("c", 5, 1)
    for r in (a, b, c):
        s.add_request(r)
    plan, _, done = step(s, {"a": EOS, "b": 7, "c": 7})
    assert [r.request_id for r in done] == ["a", "c"]
    assert [r.finish_reason for r in done] == ["stop", "length"]
    assert s.running == [b] and set(s.requests) == {"b"}
    plan, _, done = step(s, {"b": 42})
    assert done == [b] and b.stop_reason == 42
    assert_all_free(s)


def test_a_request_with_n_samples_holds_n_seats_from_admission_to_fork():
    """n=3 under max_num_seqs=3: while its prompt is still being prefilled in chunks, no
    other request may take the seats its forks will need."""
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    parent = make_request("p", 40, max_tokens=3, n=3)
    other = make_request("o", 4, max_tokens=2)
    s.add_request(parent)
    s.add_request(other)
    for _ in range(3):  # 16 + 16 + 8 prompt tokens
        out = s.schedule()
        assert [c.request.request_id for c in out.chunks] == ["p"]
        sampled = {"p": [TOKEN, TOKEN, TOKEN]} if out.chunks[0].samples else {}
        s.update(out, sampled)
    assert [r.request_id for r in s.running] == ["p", "p#1", "p#2"]
    assert list(s.waiting) == [other]
    while s.has_unfinished():
        out = s.schedule()
        assert len(out.chunks) <= 3
        s.update(out, {c.request.request_id: [TOKEN] * c.request.num_samples_to_draw
                       for c in out.chunks if c.samples})
    assert other.finish_reason == "length" and s.pool.num_free == s.pool.num_blocks
    s.pool.check_integrity()
