"""The radix prefix cache, alone and inside the Scheduler (no model).

Block ids are exact: the pool's free queue is FIFO (allocate from the left, free to the
right) and a request's blocks are freed last-first. `tree(cache)` draws the tree as
nested (token_ids, block_ids, children) tuples, children in key order.

The property test at the end drives 1000 random requests through a small pool with a
fake KV cache: every scheduled token "writes" its id into its block slot, and before a
chunk runs, every slot the request counts as computed must hold that request's token.
A cache hit that pointed at the wrong block, a block evicted while in use, or a shared
block overwritten would all show there.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ember.scheduler.prefix_cache as prefix_cache_module
import ember.scheduler.scheduler as scheduler_module
from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import NullPrefixCache, RadixPrefixCache, make_prefix_cache
from ember.scheduler.scheduler import Scheduler

EOS = 2


def tree(cache: RadixPrefixCache, node=None):
    node = node or cache.root
    return [(list(c.token_ids), list(c.block_ids), tree(cache, c))
            for _, c in sorted(node.children.items())]


def check(pool: BlockPool, cache: RadixPrefixCache) -> None:
    pool.check_integrity()
    cache.check_integrity()
    assert pool.num_free + pool.num_in_use + pool.num_evictable == pool.num_blocks


def cache_with(num_blocks: int = 10, block_size: int = 2) -> tuple[BlockPool, RadixPrefixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixPrefixCache(pool, block_size)


# ---- the tree alone ---------------------------------------------------------------------------

def test_insert_then_match_splits_a_node_at_the_block_where_tokens_differ():
    pool, cache = cache_with()
    blocks = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], blocks)
    assert tree(cache) == [([1, 2, 3, 4, 5, 6], [0, 1, 2], [])]
    assert cache.peek([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.peek([1, 2, 3, 9]) == 2
    assert tree(cache) == [([1, 2, 3, 4, 5, 6], [0, 1, 2], [])], "peek changes nothing"

    hit = cache.match([1, 2, 3, 4, 9, 9, 9], max_blocks=3)
    assert (hit.block_ids, hit.num_tokens) == ([0, 1], 4)
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], [([5, 6], [2], [])])]
    check(pool, cache)


def test_a_longer_partial_leaf_replaces_the_ones_it_begins_with():
    """A beam's next step caches its tail one token longer: the shorter tail it began with goes
    (every lookup it answered, the longer one answers as well), so the partial leaves under a
    node stay as many as the beams that go on, not one more a step."""
    pool, cache = cache_with(block_size=4)
    head = pool.allocate(1)  # [0]: 1 2 3 4
    cache.insert([1, 2, 3, 4], head)
    first, other = pool.allocate(1), pool.allocate(1)  # [1]: 1 2 3 4 | 5; [2]: 1 2 3 4 | 7
    cache.insert_partial([1, 2, 3, 4, 5], head + first)
    cache.insert_partial([1, 2, 3, 4, 7], head + other)
    pool.free(first + other)
    pool.share(first)  # a copy from it in flight: the tree lets it go, its user still holds it
    longer = pool.allocate(1)  # [3]: 1 2 3 4 | 5 6 7
    cache.insert_partial([1, 2, 3, 4, 5, 6, 7], head + longer)
    pool.free(longer)
    assert tree(cache) == [([1, 2, 3, 4], [0], [([5, 6, 7], [3], []), ([7], [2], [])])]
    check(pool, cache)
    assert cache.match_partial([1, 2, 3, 4, 5, 0], 1, max_tokens=2) == (3, 1)
    assert cache.match_partial([1, 2, 3, 4, 5, 6, 7, 8], 1, max_tokens=3) == (3, 3), "the exact tail"
    assert cache.match_partial([1, 2, 3, 4, 7, 8], 1, max_tokens=1) == (2, 1), "the exact tail, short"
    pool.free(first + head)  # the copy is done: block 1 is free again, not cached
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (pool.num_blocks - 3, 3, 0)
    check(pool, cache)


def test_common_length_bisects_to_the_first_difference():
    rng = random.Random(0)
    for _ in range(500):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        b = a[:rng.randrange(len(a) + 1)] + tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert prefix_cache_module._common_length(a, b) == want == prefix_cache_module._common_length(b, a)


def test_match_stops_at_max_blocks_and_at_a_partial_block():
    pool, cache = cache_with()
    cache.insert([1, 2, 3, 4, 5, 6], pool.allocate(3))
    assert cache.match([1, 2, 3, 4, 5, 6], max_blocks=2).block_ids == [0, 1]
    assert cache.match([1, 2, 3, 4, 5], max_blocks=2).block_ids == [0, 1]
    assert cache.match([1, 2, 3], max_blocks=5).block_ids == [0]  # [3] is not a whole block
    assert cache.match([9, 9, 1, 2], max_blocks=2).block_ids == []
    assert tree(cache) == [([1, 2], [0], [([3, 4], [1], [([5, 6], [2], [])])])]
    check(pool, cache)


def test_a_partial_leaf_and_a_whole_block_answer_a_hit_that_ends_inside_a_block():
    pool, cache = cache_with(block_size=4)
    whole = pool.allocate(2)  # [0, 1]: 1 2 3 4 | 5 6 7 8
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], whole)
    head = pool.allocate(1)  # [2]: 1 2 3 4 computed again by a request that goes on with 5 6 9
    cache.insert([1, 2, 3, 4], head)
    done = head + pool.allocate(1)  # its blocks, the last partly filled
    assert done == [0, 3], "the tree's copy of the first block; block 2 went back to the pool"
    cache.insert_partial([1, 2, 3, 4, 5, 6, 9], done)
    assert tree(cache) == [([1, 2, 3, 4], [0], [([5, 6, 7, 8], [1], []), ([5, 6, 9], [3], [])])]
    assert cache.insert_partial([1, 2, 3, 4, 5, 6], done) is None and len(tree(cache)[0][2]) == 2, \
        "a block already beginning with 5 6 is cached: nothing added"
    assert cache.match_partial([1, 2, 3, 4, 5, 6, 9, 9, 9], 1, max_tokens=8) == (3, 3)
    assert cache.match_partial([1, 2, 3, 4, 5, 6, 7, 0], 1, max_tokens=8) == (1, 3)
    assert cache.match_partial([1, 2, 3, 4, 5, 6, 7, 8], 1, max_tokens=2) == (1, 2)
    assert cache.match_partial([1, 2, 3, 4, 0], 1, max_tokens=4) is None
    assert cache.match_partial([1, 2, 3, 0], 0, max_tokens=3) == (0, 3), "inside the first block"
    assert cache.match_partial([1, 2, 3, 4, 5, 6], 1, max_tokens=1, salt="x") is None
    assert cache.peek([1, 2, 3, 4, 5, 6, 9, 9]) == 4, "a whole-block lookup never lands on a partial leaf"
    pool.free(whole)
    pool.free(done)
    check(pool, cache)
    cache.evict(1)  # the least recently used leaf: the partial one ([5 6 7 8] was hit after it)
    assert tree(cache) == [([1, 2, 3, 4], [0], [([5, 6, 7, 8], [1], [])])]
    more = pool.allocate(3)  # 5 6 9 9 | 10 11 12 13 | 14 15 16 17 after the first block: one node
    cache.insert([1, 2, 3, 4, 5, 6, 9, 9, 10, 11, 12, 13, 14, 15, 16, 17], [0] + more)
    pool.free(more)
    assert more == [4, 5, 6] and tree(cache)[0][2][1][:2] == ([5, 6, 9, 9, 10, 11, 12, 13, 14, 15, 16, 17], [4, 5, 6])
    assert cache.match_partial([1, 2, 3, 4, 5, 6, 9, 9, 10, 11, 0], 2, max_tokens=4) == (5, 2)
    pool.share([5])  # the scheduler holds the source while it is copied: one block, one node
    assert tree(cache)[0][2][1] == ([5, 6, 9, 9], [4], [([10, 11, 12, 13], [5], [([14, 15, 16, 17], [6], [])])])
    check(pool, cache)
    pool.free([5])
    check(pool, cache)


def test_insert_branches_and_reuses_the_trees_copy_of_a_block_computed_twice():
    pool, cache = cache_with()
    first = pool.allocate(3)  # [0, 1, 2]
    cache.insert([1, 2, 3, 4, 5, 6], first)
    second = pool.allocate(3)  # [3, 4, 5]: the same first two blocks, computed again
    cache.insert([1, 2, 3, 4, 7, 8], second)
    assert second == [0, 1, 5], "the caller's list now names the tree's blocks"
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], [([5, 6], [2], []), ([7, 8], [5], [])])]
    assert pool.ref_counts[:6] == [2, 2, 1, 0, 0, 1]
    assert list(pool._free)[-2:] == [3, 4], "the duplicates went back to the free queue"
    check(pool, cache)


def test_freed_cached_blocks_are_evictable_not_free_and_come_back_on_a_hit():
    pool, cache = cache_with(num_blocks=4)
    blocks = pool.allocate(2)
    cache.insert([1, 2, 3, 4], blocks)
    pool.free(blocks)
    assert (pool.num_free, pool.num_in_use, pool.num_evictable) == (2, 0, 2)
    hit = cache.match([1, 2, 3, 4, 5], max_blocks=2)
    pool.share(hit.block_ids)
    assert (pool.num_free, pool.num_in_use, pool.num_evictable) == (2, 2, 0)
    check(pool, cache)


def test_eviction_takes_least_recently_used_leaves_first_and_a_leafs_tail_first():
    pool, cache = cache_with(num_blocks=6)
    a = pool.allocate(2)  # [0, 1]: tokens 1 2 | 3 4
    cache.insert([1, 2, 3, 4], a)
    b = pool.allocate(3)  # [2, 3, 4]: tokens 5 6 | 7 8 | 9 9
    cache.insert([5, 6, 7, 8, 9, 9], b)
    pool.free(a)
    pool.free(b)
    cache.match([1, 2, 3, 4], max_blocks=2)  # a hit on a: now b is the least recently used
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], []), ([5, 6, 7, 8, 9, 9], [2, 3, 4], [])]
    assert (pool.num_free, pool.num_evictable) == (1, 5)

    got = pool.allocate(3)  # 1 free + 2 evicted from the LRU leaf, b, tail first
    assert got == [5, 4, 3]
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], []), ([5, 6], [2], [])]
    got = pool.allocate(2)  # b's last block, then a's tail
    assert got == [2, 1]
    assert tree(cache) == [([1, 2], [0], [])]
    assert pool.allocate(1) == [0]
    assert tree(cache) == []
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 available"):
        pool.allocate(1)
    check(pool, cache)


def test_eviction_never_takes_a_block_in_use():
    pool, cache = cache_with(num_blocks=5)
    held = pool.allocate(2)  # [0, 1], still used by a running request
    cache.insert([1, 2, 3, 4], held)
    done = pool.allocate(2)  # [2, 3], its request finished
    cache.insert([5, 6, 7, 8], done)
    pool.free(done)
    assert pool.num_available == 3
    assert pool.allocate(3) == [4, 3, 2]
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], [])]
    assert pool.ref_counts == [1, 1, 1, 1, 1]
    with pytest.raises(RuntimeError, match="0 available"):
        pool.allocate(1)
    check(pool, cache)


def test_a_parent_is_evicted_only_after_its_children():
    pool, cache = cache_with(num_blocks=4)
    a = pool.allocate(2)
    cache.insert([1, 2, 3, 4], a)
    hit = cache.match([1, 2, 5, 6], max_blocks=2)  # a second request shares [1 2] ...
    pool.share(hit.block_ids)
    b = hit.block_ids + pool.allocate(1)
    cache.insert([1, 2, 5, 6], b)  # ... and adds its own [5 6], touched last
    pool.free(a)
    pool.free(b)
    assert tree(cache) == [([1, 2], [0], [([3, 4], [1], []), ([5, 6], [2], [])])]
    assert pool.allocate(3) == [3, 1, 2]  # the free one, then the leaves by age; their parent [1 2] stays
    assert tree(cache) == [([1, 2], [0], [])]
    check(pool, cache)


def test_a_big_pool_evicts_a_batch_at_a_time():
    pool, cache = cache_with(num_blocks=128)  # evictions free at least 128 // 64 = 2 blocks
    a = pool.allocate(3)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    pool.free(a)
    pool.allocate(125)  # every free block
    assert pool.allocate(1) == [2], "the leaf's last two blocks were evicted, the last first"
    assert tree(cache) == [([1, 2], [0], [])]
    assert (pool.num_free, pool.num_evictable) == (1, 1)
    check(pool, cache)


def test_make_prefix_cache_off_is_the_null_object():
    pool = BlockPool(4)
    off = make_prefix_cache(False, pool, 2)
    assert isinstance(off, NullPrefixCache) and pool.evictor is None
    blocks = pool.allocate(2)
    off.insert([1, 2, 3, 4], blocks)
    assert off.match([1, 2, 3, 4, 5], 2).block_ids == [] and off.peek([1, 2, 3, 4]) == 0
    pool.free(blocks)
    assert pool.num_free == 4 and pool.num_evictable == 0


# ---- holes: a sliding window let a request give back the head of its path ----------------------

def test_a_window_cuts_the_path_where_a_request_lets_go_and_an_idle_head_becomes_a_hole():
    pool, cache = cache_with(num_blocks=6)
    null = pool.null_block
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = pool.allocate(3)  # [0, 1, 2]
    cache.insert(tokens, blocks)
    cache.split(tokens, 2)  # the request's window passed blocks 0 and 1: it keeps only 2
    pool.free(blocks[:2])
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], [([5, 6], [2], [])])]
    assert (pool.num_free, pool.num_in_use, pool.num_evictable) == (3, 1, 2)
    check(pool, cache)

    assert pool.allocate(4) == [3, 4, 5, 1]  # 3 free, then the idle head, given back whole (0 goes last)
    assert tree(cache) == [([1, 2, 3, 4], [null, null], [([5, 6], [2], [])])]
    assert cache.match(tokens, max_blocks=3).block_ids == [null, null, 2]
    assert cache.num_cached_blocks == 1 and (pool.num_free, pool.num_evictable) == (1, 0)
    check(pool, cache)

    pool.free([2])  # the request leaves: its block is idle, then evicted with the hole above it
    assert pool.allocate(2) == [0, 2]
    assert tree(cache) == []
    check(pool, cache)


def test_insert_fills_a_hole_and_keeps_one_where_the_tree_lost_the_path():
    pool, cache = cache_with(num_blocks=8)
    null = pool.null_block
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = pool.allocate(3)  # [0, 1, 2]
    cache.insert(tokens, blocks)
    cache.split(tokens, 2)
    pool.free(blocks[:2])
    cache.evict(2)
    assert tree(cache) == [([1, 2, 3, 4], [null, null], [([5, 6], [2], [])])]

    again = pool.allocate(2)  # another request computes the head again: it fills the hole
    cache.insert(tokens[:4], again)
    assert again == [3, 4] and tree(cache) == [([1, 2, 3, 4], [3, 4], [([5, 6], [2], [])])]
    check(pool, cache)

    pool.free(again)
    pool.free([2])
    pool.allocate(8)  # everything is evicted: the tree is empty
    pool.free([0, 1, 2, 3, 4, 5, 6, 7])
    assert tree(cache) == []
    # a request that gave back its first two blocks caches its third: the tree lost their
    # path, a hole stands in for it
    mine = pool.allocate(1)  # [7]: the free queue got 7 .. 0 back, last-first
    cache.insert(tokens, [null, null] + mine)
    assert tree(cache) == [([1, 2, 3, 4], [null, null], [([5, 6], [7], [])])]
    check(pool, cache)


def test_a_request_holding_a_nodes_tail_swaps_only_that_part_for_the_trees_copy():
    pool, cache = cache_with(num_blocks=8)
    null = pool.null_block
    tokens = [1, 2, 3, 4, 5, 6]
    done = pool.allocate(3)  # [0, 1, 2]: a finished request's blocks, idle in the tree
    cache.insert(tokens, done)
    pool.free(done)
    mine = [null] + pool.allocate(2)  # [null, 3, 4]: computed 3 4 | 5 6 again, gave back the head
    cache.insert(tokens, mine)
    assert mine == [null, 1, 2], "the caller now holds the tree's copies"
    assert tree(cache) == [([1, 2], [0], [([3, 4, 5, 6], [1, 2], [])])]
    assert pool.ref_counts[:5] == [0, 1, 1, 0, 0] and list(pool._free)[-2:] == [3, 4]
    check(pool, cache)


# ---- inside the scheduler -------------------------------------------------------------------

def make(num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64,
         policy: str = "fcfs") -> Scheduler:
    pool = BlockPool(num_blocks)
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=256, scheduling_policy=policy)
    return Scheduler(pool, config, RadixPrefixCache(pool, block_size))


def request(rid: str, prompt: list[int], max_tokens: int = 3, **params) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params),
                   eos_token_ids=frozenset({EOS}))


def run(s: Scheduler, tokens: dict[str, list[int]] | None = None) -> list[tuple[str, int]]:
    """Step until idle; request i samples tokens[i] in turn (else 7). Returns [(id, n)] per chunk."""
    plan, tokens = [], {k: list(v) for k, v in (tokens or {}).items()}
    while s.has_unfinished():
        out = s.schedule()
        plan += [(c.request.request_id, c.num_new_tokens) for c in out.chunks]
        sampled = {c.request.request_id: [(tokens.get(c.request.request_id) or [7]).pop(0)]
                   for c in out.chunks if c.samples}
        s.update(out, sampled)
        s.pool.check_integrity()
        s.prefix_cache.check_integrity()
    assert s.pool.num_in_use == 0
    return plan


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107], then 2 more


def test_a_repeated_prompt_reuses_its_full_blocks_and_copies_the_block_it_ends_in():
    s = make()
    first = request("a", PROMPT)
    s.add_request(first)
    assert run(s) == [("a", 10), ("a", 1), ("a", 1)]
    assert first.num_cached_tokens == 0
    # a's 12 tokens with KV (10 prompt + 2 of 3 outputs) filled three blocks: all cached
    assert tree(s.prefix_cache) == [(PROMPT[:8], [0, 1], [(PROMPT[8:] + [7, 7], [2], [])])]

    again = request("b", PROMPT)
    s.add_request(again)
    out = s.schedule()
    # two whole blocks, then block 2's first token (108; 109 is left to compute) copied into block 3
    assert again.block_ids == [0, 1, 3] and again.num_computed_tokens == 9
    assert out.block_copies == [(2, 3)] and out.free_when_collected == [2]
    assert s.pool.ref_counts[:4] == [1, 1, 1, 1], "the copy's source is held until the step is collected"
    assert again.num_cached_tokens == 9
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 9)
    s.update(out, {"b": [7]})
    assert s.pool.ref_counts[2] == 0 and s.pool.cached[2]


def test_the_last_token_is_always_computed_even_when_all_blocks_are_cached():
    s = make()
    s.add_request(request("a", PROMPT[:8], max_tokens=1))
    run(s)
    b = request("b", PROMPT[:8], max_tokens=1)
    s.add_request(b)
    assert run(s) == [("b", 1)], "8 tokens cached in 2 blocks: the second is copied, its last token runs again"
    assert b.num_cached_tokens == 7


def test_the_next_turn_reuses_the_previous_turns_output_to_its_last_token():
    s = make()
    turn1 = request("t1", PROMPT, max_tokens=6)
    s.add_request(turn1)
    run(s, {"t1": [20, 21, 22, 23, 24, 25]})
    history = PROMPT + [20, 21, 22, 23, 24, 25]  # 16 tokens; the last (25) never got KV
    # turn 1 held blocks 0..3; its 15 tokens with KV filled 0, 1, 2 (prompt, then 108 109 20 21) and
    # three of block 3's slots (22 23 24): kept as a partial leaf
    assert tree(s.prefix_cache) == [(PROMPT[:8], [0, 1], [([108, 109, 20, 21], [2], [([22, 23, 24], [3], [])])])]
    turn2 = request("t2", history + [30, 31, 32])
    s.add_request(turn2)
    out = s.schedule()
    assert turn2.num_computed_tokens == 15 and turn2.block_ids == [0, 1, 2, 4, 5]
    assert out.block_copies == [(3, 4)] and [c.num_new_tokens for c in out.chunks] == [4]
    s.update(out, {"t2": [7]})
    run(s)
    # turn 2's block 4 (22 23 24 25) is whole now: the partial leaf it began with went
    assert [k for k in s.prefix_cache.root.children[tuple(PROMPT[:4])].children[tuple(PROMPT[8:10]) + (20, 21)]
            .children] == [(22, 23, 24, 25)]
    assert not s.pool.cached[3] and s.pool.ref_counts[3] == 0


def test_prompt_logprobs_requests_do_not_read_the_cache():
    s = make()
    s.add_request(request("a", PROMPT))
    run(s)
    b = request("b", PROMPT, prompt_logprobs=1)
    s.add_request(b)
    s.schedule()
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == 0


def test_a_request_admitted_with_a_hit_that_then_cannot_fit_gives_the_hit_back():
    s = make(num_blocks=6, max_num_seqs=8, budget=64)
    s.add_request(request("a", PROMPT, max_tokens=1))
    run(s)  # cached: [100..103] [104..107] in blocks 0, 1; free: 3, 4, 5, 2
    s.add_request(request("big", list(range(200, 216)), max_tokens=1))  # takes the 4 free blocks
    c = request("c", PROMPT + list(range(300, 310)), max_tokens=1)  # hits 2 blocks, needs 3 more
    s.add_request(c)
    out = s.schedule()
    assert [ch.request.request_id for ch in out.chunks] == ["big"]
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.status is RequestStatus.WAITING
    assert s.pool.ref_counts[:2] == [0, 0] and s.pool.num_evictable == 2
    s.pool.check_integrity()


def test_lpm_admits_the_longest_cached_prefix_first_but_nobody_starves(monkeypatch):
    s = make(max_num_seqs=1, policy="lpm")
    s.add_request(request("warm", PROMPT, max_tokens=1))
    run(s)
    cold = request("cold", list(range(500, 510)), max_tokens=1)
    hot = request("hot", PROMPT, max_tokens=1)
    s.add_request(cold)
    s.add_request(hot)
    assert [rid for rid, _ in run(s)] == ["hot", "cold"]

    monkeypatch.setattr(scheduler_module, "LPM_MAX_PASSED_OVER", 2)
    old = request("old", list(range(600, 610)), max_tokens=1)
    s.add_request(old)
    for i in range(4):
        s.add_request(request(f"hot{i}", PROMPT, max_tokens=1))
    assert [rid for rid, _ in run(s)] == ["hot0", "hot1", "old", "hot2", "hot3"]


@pytest.mark.parametrize("policy,max_queue", [("fcfs", 128), ("lpm", 1)], ids=["fcfs", "lpm-past-its-queue-bound"])
def test_arrival_order_ignores_cached_prefixes(monkeypatch, policy, max_queue):
    monkeypatch.setattr(scheduler_module, "LPM_MAX_QUEUE", max_queue)
    s = make(max_num_seqs=1, policy=policy)
    s.add_request(request("warm", PROMPT, max_tokens=1))
    run(s)
    s.add_request(request("cold", list(range(500, 510)), max_tokens=1))
    s.add_request(request("hot", PROMPT, max_tokens=1))
    assert [rid for rid, _ in run(s)] == ["cold", "hot"]


def test_forks_of_an_n_request_cache_their_blocks_once():
    s = make()
    parent = request("p", PROMPT, max_tokens=3, n=3, seed=None)
    s.add_request(parent)
    out = s.schedule()
    s.update(out, {"p": [40, 41, 42]})
    assert s.pool.ref_counts[0:2] == [3, 3]  # prompt's two full blocks: parent and two forks
    s.prefix_cache.check_integrity()
    run(s)
    s.pool.check_integrity()
    assert tree(s.prefix_cache)[0][1] == [0, 1]


def test_requests_over_one_fresh_prefix_compute_it_once():
    """b and d start with a's uncached blocks: they wait one step and hit them (c, another
    prompt, is not held up); a request also waits while a chunked prefill computes its block."""
    s = make()
    prefix = list(range(100, 112))  # three blocks
    a, b, d = (request(rid, prefix + tail, max_tokens=1) for rid, tail in (("a", [1, 2]), ("b", [3, 4]), ("d", [5, 6])))
    c = request("c", list(range(500, 511)), max_tokens=1)
    for r in (a, b, c, d):
        s.add_request(r)
    out = s.schedule()
    assert [(ch.request.request_id, ch.num_new_tokens) for ch in out.chunks] == [("a", 14), ("c", 11)]
    assert (a.block_ids, c.block_ids, b.block_ids, d.block_ids) == ([0, 1, 2, 3], [4, 5, 6], [], [])
    assert [r.request_id for r in s.waiting] == ["b", "d"]
    s.update(out, {"a": [7], "c": [7]})
    out = s.schedule()
    assert [(ch.request.request_id, ch.num_new_tokens) for ch in out.chunks] == [("b", 2), ("d", 2)]
    assert (b.block_ids, d.block_ids) == ([0, 1, 2, 7], [0, 1, 2, 8])  # the hit, then a fresh block
    assert (b.num_cached_tokens, d.num_cached_tokens) == (12, 12)
    s.update(out, {"b": [7], "d": [7]})
    assert (s.prefix_cache_queries - s.prefix_cache_hits) == 14 + 11 + 2 + 2

    s = make(budget=8)  # a's prefill takes two steps: b waits for each block a's chunks compute
    a, b = request("a", prefix + [1, 2], max_tokens=1), request("b", prefix + [3, 4], max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    assert run(s) == [("a", 8), ("a", 6), ("b", 2)]
    assert b.num_cached_tokens == 12


# ---- 1000 random requests through a small pool ---------------------------------------------

PREFIXES = [[1000 + 37 * p + i for i in range(length)] for p, length in enumerate([0, 5, 9, 16, 23, 40])]


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the same history gives the same token, as real greedy does."""
    return EOS if (tokens[-1] * 7 + len(tokens)) % 29 == 0 else 3000 + (tokens[-1] * 31 + len(tokens)) % 97


@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), pool_tokens=st.integers(48, 160), block_size=st.sampled_from([1, 2, 4]),
       policy=st.sampled_from(["fcfs", "lpm", "priority"]))
def test_random_shared_prefix_workload_leaks_nothing_and_reads_only_its_own_kv(seed, pool_tokens, block_size, policy):
    rng = random.Random(seed)
    num_blocks = pool_tokens // block_size
    pool = BlockPool(num_blocks)
    cache = RadixPrefixCache(pool, block_size)
    s = Scheduler(pool, EngineConfig(block_size=block_size, max_num_seqs=6, max_num_batched_tokens=24,
                                     max_model_len=64, scheduling_policy=policy), prefix_cache=cache)
    kv: dict[int, list[int | None]] = {b: [None] * block_size for b in range(num_blocks)}
    histories: list[list[int]] = []
    to_abort: dict[str, int] = {}
    num_added, hits, steps = 0, 0, 0
    while num_added < 100 or s.has_unfinished():
        while num_added < 100 and len(s.waiting) < 4 and rng.random() < 0.6:
            if histories and rng.random() < 0.3:  # a next turn: an earlier request's whole history
                prompt = list(rng.choice(histories))
            else:
                prompt = list(rng.choice(PREFIXES))
            prompt += [rng.randrange(5, 900) for _ in range(rng.randint(1, 8))]
            prompt = prompt[-30:]
            rid = f"r{num_added}"
            req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 10),
                                                      n=rng.choice([1, 1, 1, 2]), seed=None),
                          eos_token_ids=frozenset({EOS}), priority=rng.randint(0, 2))
            s.add_request(req)
            num_added += 1
            if rng.random() < 0.15:
                to_abort[rid] = steps + rng.randint(0, 6)
        for rid, when in list(to_abort.items()):
            if when <= steps:
                s.abort(rid)
                del to_abort[rid]
        out = s.schedule()
        for src, dst in out.block_copies:
            kv[dst] = list(kv[src])
        sampled = {}
        for chunk in out.chunks:
            req, tokens = chunk.request, chunk.request.all_token_ids
            for pos in range(req.num_computed_tokens):  # what attention would read
                assert kv[req.block_ids[pos // block_size]][pos % block_size] == tokens[pos], \
                    f"{req.request_id} reads the wrong KV at position {pos}"
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + chunk.num_new_tokens):
                block = req.block_ids[pos // block_size]
                assert pool.ref_counts[block] == 1 and not pool.cached[block], "a shared block is written"
                kv[block][pos % block_size] = tokens[pos]
            if chunk.samples:
                draws = req.num_samples_to_draw
                sampled[req.request_id] = [fake_next_token(tokens)] * draws
        _, finished = s.update(out, sampled)
        for req in finished:
            histories.append(req.all_token_ids)
            hits += req.num_cached_tokens or 0
        pool.check_integrity()
        cache.check_integrity()
        for req in s.running:
            assert all(pool.ref_counts[b] > 0 for b in req.block_ids)
        steps += 1
        assert steps < 20_000
    assert pool.num_in_use == 0 and pool.ref_counts == [0] * num_blocks
    assert pool.num_free + pool.num_evictable == num_blocks
    assert s.prefix_cache_hits > 0, "the workload never hit the cache: it tests nothing"


def test_a_cache_salt_shares_blocks_only_within_its_salt_and_its_tree_goes_once_evicted():
    pool, cache = cache_with(num_blocks=6)
    plain, salted = pool.allocate(2), pool.allocate(2)  # [0, 1] and [2, 3]
    cache.insert([1, 2, 3, 4], plain)
    cache.insert([1, 2, 3, 4], salted, salt="tenant-a")
    assert salted == [2, 3], "the unsalted tree's copy is not swapped in"
    assert cache.match([1, 2, 3, 4, 5], 2).block_ids == [0, 1]
    assert cache.match([1, 2, 3, 4, 5], 2, salt="tenant-a").block_ids == [2, 3]
    assert cache.match([1, 2, 3, 4, 5], 2, salt="tenant-b").block_ids == []
    assert (cache.peek([1, 2, 3, 4], "tenant-a"), cache.peek([1, 2, 3, 4], "tenant-b")) == (4, 0)
    assert "tenant-b" not in cache.salted, "a lookup plants no tree"
    assert tree(cache, cache.salted["tenant-a"]) == [([1, 2, 3, 4], [2, 3], [])]
    check(pool, cache)
    pool.free(plain)
    pool.free(salted)
    cache.match([1, 2, 3, 4, 5], 2)  # the unsalted path is the most recently used
    cache.evict(2)
    assert tree(cache) == [([1, 2, 3, 4], [0, 1], [])] and cache.salted == {}
    check(pool, cache)


def test_requests_of_another_salt_get_no_hit():
    s = make()
    s.add_request(request("a", PROMPT))
    run(s)
    for rid, salt, hit in (("b", "x", 0), ("c", "x", 9), ("d", None, 9), ("e", "y", 0)):
        req = request(rid, PROMPT)
        req.cache_salt = salt
        s.add_request(req)
        run(s)
        assert req.num_cached_tokens == hit, rid
