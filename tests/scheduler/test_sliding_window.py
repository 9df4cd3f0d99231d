"""The Scheduler with a sliding window on every layer, no model: blocks that no future query
can see go back to the pool, and block tables keep their places with the null block.

Block ids are exact (the pool's free queue is FIFO, a request's blocks are freed
last-first). `check` asserts after every step, on top of the pool's and tree's own
checks: each request holds exactly its table's entries from `num_released_blocks` on,
the ones before are the null block, and a running request in a synchronous loop holds
precisely the blocks its next query can see.
"""

from __future__ import annotations

import random

import pytest

from ember.config import EngineConfig
from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import RadixPrefixCache
from ember.scheduler.scheduler import Scheduler, SchedulerOutput
from ember.scheduler.sliding_window import FullContextBlocks, SlidingWindowBlocks, shared_window

EOS = 2
T = 7  # a plain sampled token


def make(num_blocks: int, window: int | None, block_size: int = 4, budget: int = 64, max_model_len: int = 256,
         prefix_caching: bool = False, max_num_seqs: int = 8) -> Scheduler:
    pool = BlockPool(num_blocks)
    cache = RadixPrefixCache(pool, block_size) if prefix_caching else None
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=max_model_len)
    return Scheduler(pool, config, prefix_cache=cache, sliding_window=window)


def request(rid: str, prompt: list[int] | int, max_tokens: int, **params) -> Request:
    prompt = [100 + i for i in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=frozenset({EOS}))


def check(s: Scheduler, synchronous: bool = True) -> None:
    s.pool.check_integrity()
    s.prefix_cache.check_integrity()
    null, held = s.null_block, []
    for r in s.running:
        k = r.num_released_blocks
        assert r.block_ids[:k] == [null] * k and null not in r.block_ids[k:], (r.request_id, r.block_ids, k)
        assert len(r.block_ids) == s.blocks_for(r.num_computed_tokens)
        if synchronous and not r.num_steps_in_flight:
            assert k == s.window.first_needed(r.num_computed_tokens), (r.request_id, k, r.num_computed_tokens)
        held += r.block_ids[k:]
    for r in s.waiting:
        assert r.block_ids == [] and r.num_released_blocks == 0
    for plan in s.in_flight:  # blocks of requests that left while a launched step computes for them
        held += plan.free_when_collected
    # ref counts: one per holder (shared prefixes and forks count once each)
    for b, rc in enumerate(s.pool.ref_counts):
        assert rc == held.count(b), (b, rc, held.count(b))


def step(s: Scheduler, token=T) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {c.request.request_id: [token] * c.request.num_samples_to_draw for c in out.chunks if c.samples})
    check(s)
    return out


def plan_of(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


# ---- the window's arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize("window,block_size", [(1, 4), (6, 4), (8, 4), (9, 4), (64, 16), (7, 8), (2047, 16)])
def test_first_needed_and_most_held_follow_the_attention_contract(window, block_size):
    w = SlidingWindowBlocks(block_size, window)
    most = 0
    for p in range(3 * window + 2 * block_size):
        f = w.first_needed(p)
        seen = [k for k in range(p + 1) if p - window < k]  # what a query at p sees (base.py)
        assert f == seen[0] // block_size, "the first needed block holds the first key the query sees"
        most = max(most, p // block_size + 1 - f)  # blocks held while position p is computed
    assert w.most_held(10**6) == most
    assert w.most_held(5) == min(most, 2 if block_size == 4 else 1)


def test_the_shared_window_is_the_largest_and_only_when_every_layer_has_one():
    assert shared_window((64, 64, 64)) == 64
    assert shared_window((32, 64, 48)) == 64
    assert shared_window((7, None, 7, None)) is None  # Gemma 2: global layers keep everything
    assert shared_window(None) is None
    assert FullContextBlocks(4).first_needed(10**6) == 0
    assert FullContextBlocks(4).most_held(9) == 3
    with pytest.raises(ValueError, match="at least one token"):
        SlidingWindowBlocks(4, 0)


def test_a_hit_is_usable_up_to_the_last_boundary_whose_window_has_every_block():
    w, n = SlidingWindowBlocks(4, 6), -1  # -1: a hole
    assert w.usable_hit([n, n, 2, 3, 4], n) == 5  # the query at 20 sees 15.. : blocks 3, 4
    assert w.usable_hit([n, n, 2], n) == 0  # at 12 it needs block 1; at 8 block 0
    assert w.usable_hit([0, 1, n, 3], n) == 2
    assert FullContextBlocks(4).usable_hit([0, 1, n, 3], n) == 2
    assert FullContextBlocks(4).usable_hit([0, 1, 2], n) == 3


# ---- one request's table ----------------------------------------------------------------------

def test_blocks_before_the_window_go_back_and_the_table_keeps_their_places():
    s = make(num_blocks=16, window=6)  # block size 4
    N = s.null_block
    a = request("a", 10, max_tokens=8)
    s.add_request(a)
    assert plan_of(step(s)) == [("a", 10)]
    # computed 10: the next query (at 10) sees 5..10, so block 0 (positions 0..3) goes
    assert a.block_ids == [N, 1, 2] and a.num_released_blocks == 1
    assert list(s.pool._free)[-1] == 0 and s.pool.num_in_use == 2
    step(s)  # position 10
    step(s)  # position 11: the next query (12) sees 7..12, block 1 still needed
    assert a.block_ids == [N, 1, 2]
    step(s)  # position 12 opens a block; the next (13) sees 8.., so block 1 goes
    assert a.block_ids == [N, N, 2, 3] and s.pool.ref_counts[:4] == [0, 0, 1, 1]
    while s.has_unfinished():
        step(s)
    assert a.output_token_ids == [T] * 8 and s.pool.num_free == 16


def test_without_a_window_every_block_stays_until_the_request_leaves():
    s = make(num_blocks=16, window=None)
    a = request("a", 10, max_tokens=8)
    s.add_request(a)
    step(s)
    for _ in range(5):
        step(s)
    assert a.block_ids == [0, 1, 2, 3] and a.num_released_blocks == 0 and s.pool.num_in_use == 4


def test_a_request_whose_context_outgrows_the_pool_runs_within_its_window():
    # 20 + 20 tokens need 10 blocks of 4; the pool has 4, the window (6) needs at most 3
    s = make(num_blocks=4, window=6)
    N = s.null_block
    a = request("a", 20, max_tokens=20)
    s.add_request(a)  # accepted: check_request asks for the window's 3 blocks, not 10
    out = step(s)
    assert plan_of(out) == [("a", 16)], "the chunk is cut to fit the whole pool"
    assert a.block_ids == [N, N, 2, 3]
    out = step(s)
    assert plan_of(out) == [("a", 4)] and a.block_ids == [N, N, N, 3, 1]
    steps = 2
    while s.has_unfinished():
        step(s)
        steps += 1
        assert s.pool.num_in_use <= 3
    assert steps == 21 and a.num_preemptions == 0 and a.output_token_ids == [T] * 20
    assert s.pool.num_free == 4

    with pytest.raises(ValueError, match="whose KV needs 10 blocks, but the whole pool has 4"):
        make(num_blocks=4, window=None).add_request(request("b", 20, max_tokens=20))
    with pytest.raises(ValueError, match="whose KV needs 3 blocks, but the whole pool has 2"):
        make(num_blocks=2, window=6).add_request(request("c", 20, max_tokens=20))


def test_two_long_requests_share_a_small_pool_by_preemption_and_both_finish():
    s = make(num_blocks=5, window=6, budget=8)
    a, b = request("a", 30, max_tokens=10), request("b", 26, max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < 500
    assert a.output_token_ids == [T] * 10 and b.output_token_ids == [T] * 12
    assert a.num_preemptions + b.num_preemptions > 0, "the pool is too small for both at once: this tests preemption"
    assert s.pool.num_free == 5


def test_abort_and_preemption_give_back_exactly_the_blocks_still_held():
    s = make(num_blocks=16, window=6)
    a = request("a", 14, max_tokens=10)
    s.add_request(a)
    step(s)
    assert a.num_released_blocks == 2 and s.pool.num_in_use == 2
    s._preempt(a, SchedulerOutput())  # what running out of blocks does
    assert a.block_ids == [] and a.num_released_blocks == 0 and s.pool.num_free == 16
    check(s)
    step(s)  # readmitted: computes its 14 tokens again
    assert a.num_computed_tokens == 15 and a.num_released_blocks == 2
    s.abort("a")
    assert a.block_ids == [] and s.pool.num_free == 16 and s.pool.ref_counts == [0] * 16


def test_forks_of_an_n_request_inherit_the_released_head_and_share_the_rest():
    s = make(num_blocks=16, window=6)
    N = s.null_block
    p = request("p", 14, max_tokens=3, n=2, seed=None)
    s.add_request(p)
    out = s.schedule()
    s.update(out, {"p": [40, 41]})
    child = s.requests["p#1"]
    # 14 computed: blocks 0, 1 go (the next query, 14, sees 9..); block 3 is partial: copied
    assert p.block_ids == [N, N, 2, 3] and child.block_ids == [N, N, 2, 4]
    assert child.num_released_blocks == 2 and s.pool.ref_counts[:5] == [0, 0, 2, 1, 1]
    assert s._pending_copies == [(3, 4)]
    check(s)
    while s.has_unfinished():
        step(s)
    assert s.pool.num_free == 16


# ---- with the prefix cache --------------------------------------------------------------------

PROMPT = [100 + i for i in range(24)]


def test_released_blocks_stay_cached_and_a_hit_takes_only_its_windows_blocks():
    s = make(num_blocks=16, window=6, budget=8, prefix_caching=True)
    N = s.null_block
    a = request("a", PROMPT, max_tokens=1)
    s.add_request(a)
    step(s)
    step(s)
    assert a.block_ids == [N, N, 2, 3] and s.pool.num_evictable == 2, "given back, still cached"
    step(s)
    assert not s.has_unfinished() and s.pool.num_evictable == 6

    b = request("b", PROMPT, max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    # 5 whole blocks hit (the last token is always computed); b's query at 20 sees 15..,
    # so it takes blocks 3 and 4 and not 0..2
    assert plan_of(out) == [("b", 4)] and b.num_cached_tokens == 20
    assert b.block_ids == [N, N, N, 3, 4, 6] and b.num_released_blocks == 3
    assert s.pool.ref_counts[:7] == [0, 0, 0, 1, 1, 0, 1]
    s.update(out, {"b": [T]})
    check(s)


def test_a_hole_in_the_cache_ends_a_hit_where_the_window_would_read_it_and_is_filled_again():
    s = make(num_blocks=5, window=6, budget=8, prefix_caching=True)
    N = s.null_block
    a = request("a", PROMPT, max_tokens=1)
    s.add_request(a)
    step(s)
    step(s)  # a gave back blocks 0, 1 (cached, idle)
    step(s)  # its last chunk needs 2 blocks, 1 is free: the idle head is evicted, a hole
    tree = s.prefix_cache.root.children
    (head,) = tree.values()
    assert head.block_ids == [N, N] and s.pool.num_evictable == 4

    b = request("b", PROMPT, max_tokens=1)  # needs blocks 3, 4 for its window: all there
    s.add_request(b)
    out = s.schedule()
    assert b.num_computed_tokens == 20 and b.block_ids == [N, N, N, 3, 4, 0]
    s.update(out, {"b": [T]})  # b's last block duplicates a's (block 1): it keeps the tree's, 0 is free
    check(s)
    assert s.pool.num_free == 1 and s.pool.num_evictable == 4

    c = request("c", PROMPT[:12] + [900, 901, 902, 903], max_tokens=1)
    s.add_request(c)  # the query at 12 would need block 1, a hole; at 8 block 0: no hit
    out = s.schedule()
    assert plan_of(out) == [("c", 8)] and c.num_cached_tokens == 0
    s.update(out, {"c": [T]})
    check(s)
    assert c.block_ids == [0, 1] and head.block_ids == [0, 1], "c's first blocks filled the hole"
    while s.has_unfinished():
        step(s)
    assert s.pool.num_in_use == 0


# ---- async scheduling: a step in flight never loses a block it reads ---------------------------

@pytest.mark.parametrize("seed", range(4))
def test_with_a_step_in_flight_blocks_go_back_only_past_every_launched_query(seed):
    rng = random.Random(seed)
    s = make(num_blocks=12, window=rng.choice([3, 6, 9]), budget=rng.choice([4, 8, 16]), prefix_caching=True)
    stems = [[rng.randrange(100, 200) for _ in range(rng.randrange(4, 20))] for _ in range(2)]
    for i in range(6):
        prompt = rng.choice(stems) + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 12))]
        s.add_request(request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
    launched: list[SchedulerOutput] = []
    steps = 0
    while s.has_unfinished() or launched:
        if launched and launched[-1].short_of_blocks:
            done = launched.pop(0)  # the engine collects first: the next schedule may preempt
            s.update(done, {c.request.request_id: [T] for c in done.chunks if c.samples})
        out = s.schedule()
        if not out.is_empty:
            s.mark_launched(out)
            launched.append(out)
        while len(launched) > 1 or (launched and out.is_empty):
            done = launched.pop(0)
            s.update(done, {c.request.request_id: [T] for c in done.chunks if c.samples})
        for plan in launched:  # every block the in-flight queries can see is held
            for c in plan.chunks:
                req = c.request
                if not req.status.is_finished:
                    first = s.window.first_needed(c.start)
                    assert req.num_released_blocks <= first
                    assert all(s.pool.ref_counts[b] > 0 for b in req.block_ids[first:]), req.request_id
        check(s, synchronous=False)
        steps += 1
        assert steps < 2000
    assert s.pool.num_in_use == 0 and not s.requests


# ---- random workloads: each query reads the right KV in its window ------------------------------

def fake_next_token(tokens: list[int]) -> int:
    """The same history gives the same token, as greedy decoding does."""
    return 3000 + (tokens[-1] * 31 + len(tokens)) % 97


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_read_the_right_kv_in_every_window_and_leak_nothing(seed):
    """Shared prefixes, next turns, forks, aborts, chunked prefill and a pool small enough
    to preempt and evict: a fake KV cache records which token each slot holds, and each
    chunk's queries must find their own tokens at every position their windows see."""
    rng = random.Random(seed)
    block_size, window = rng.choice([(1, 3), (2, 5), (4, 6), (4, 9), (4, 16)])
    num_blocks = max(SlidingWindowBlocks(block_size, window).most_held(10**6) + 2, rng.randrange(6, 20))
    s = make(num_blocks, window, block_size, budget=rng.choice([5, 12, 24]), max_model_len=96,
             prefix_caching=seed % 4 != 3, max_num_seqs=4)
    kv = {b: [None] * block_size for b in range(num_blocks)}
    stems = [[1000 + 37 * p + i for i in range(rng.randrange(5, 40))] for p in range(3)]
    histories: list[list[int]] = []
    num_added = steps = 0
    while num_added < 40 or s.has_unfinished():
        if num_added < 40 and len(s.waiting) < 3 and rng.random() < 0.5:
            prompt = list(rng.choice(histories)) if histories and rng.random() < 0.3 else list(rng.choice(stems))
            prompt = (prompt + [rng.randrange(5, 900) for _ in range(rng.randint(1, 8))])[-60:]
            s.add_request(request(f"r{num_added}", prompt, rng.randint(1, 20), n=rng.choice([1, 1, 2]), seed=None))
            num_added += 1
        if s.running and rng.random() < 0.03:
            s.abort(rng.choice(s.running).request_id.split("#")[0])
        out = s.schedule()
        for src, dst in out.block_copies:
            kv[dst] = list(kv[src])
        sampled = {}
        for chunk in out.chunks:
            req, tokens = chunk.request, chunk.request.all_token_ids
            start, end = chunk.start, chunk.start + chunk.num_new_tokens
            for pos in range(max(0, start - window + 1), start):  # what the chunk's windows read
                assert kv[req.block_ids[pos // block_size]][pos % block_size] == tokens[pos], \
                    f"{req.request_id} reads the wrong KV at position {pos}"
            for pos in range(start, end):
                block = req.block_ids[pos // block_size]
                assert s.pool.ref_counts[block] == 1 and not s.pool.cached[block], "a shared block is written"
                kv[block][pos % block_size] = tokens[pos]
            if chunk.samples:
                sampled[req.request_id] = [fake_next_token(tokens)] * req.num_samples_to_draw
        _, finished = s.update(out, sampled)
        histories += [r.all_token_ids for r in finished]
        check(s)
        steps += 1
        assert steps < 5000
    assert s.pool.num_in_use == 0 and s.pool.num_free + s.pool.num_evictable == num_blocks
