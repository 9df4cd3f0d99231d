"""Recurrent-state snapshots (scheduler/state_snapshots.py) on the real Scheduler, radix tree and
block pool, no model: where chunks are cut and states saved, which snapshot a hit restores, how
many are kept and what goes when. Exact positions, snapshot slots (taken slot 0 first) and block
ids (the pool's free queue is FIFO)."""

from __future__ import annotations

from ember.config import EngineConfig
from ember.request import Request
from ember.sampling_params import SamplingParams
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import RadixPrefixCache
from ember.scheduler.scheduler import Scheduler, SchedulerOutput
from ember.scheduler.state_snapshots import StateSnapshots

T = 7  # every sampled token
PROMPT = list(range(100, 127))  # 27 tokens


def make_scheduler(block_size: int = 8, budget: int = 64, num_blocks: int = 64,
                   num_snapshots: int = 8) -> Scheduler:
    pool = BlockPool(num_blocks)
    config = EngineConfig(block_size=block_size, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128)
    return Scheduler(pool, config, RadixPrefixCache(pool, block_size), None,
                     StateSnapshots(num_snapshots, block_size))


def request(rid: str, prompt: list[int], max_tokens: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def plan_of(out: SchedulerOutput) -> list[tuple]:
    """A step as [(request id, first position, tokens)], its saves and its restores."""
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in out.chunks], out.state_saves, out.state_restores


def run(s: Scheduler, *reqs: Request) -> list[tuple]:
    """Add the requests, step until all are done (every token sampled is T); the plans."""
    for r in reqs:
        s.add_request(r)
    plans = []
    while s.has_unfinished():
        out = s.schedule()
        plans.append(plan_of(out))
        s.update(out, {c.request.request_id: [T] for c in out.chunks if c.samples})
    check(s)
    return plans


def check(s: Scheduler) -> None:
    s.pool.check_integrity()
    s.prefix_cache.check_integrity()
    s.snapshots.check_integrity(s.pool.cached)
    assert not s.snapshots.held_for()


def keyed(s: Scheduler) -> dict[int, int]:
    """block id -> snapshot slot, least recently used first."""
    return dict(s.snapshots.by_block)


def test_prefill_chunks_end_on_block_boundaries_and_the_last_starts_at_the_last_one():
    """27 tokens, blocks of 8, a 5-token budget: chunks end at 8, 16 and 24 where they can, the
    last is the tail after 24; a state is saved at each boundary and keyed by the block it ends."""
    s = make_scheduler(budget=5)
    plans = run(s, request("a", PROMPT))
    assert [p[0] for p in plans] == [[("a", 0, 5)], [("a", 5, 3)], [("a", 8, 5)], [("a", 13, 3)], [("a", 16, 5)],
                                     [("a", 21, 3)], [("a", 24, 3)]]
    assert [p[1] for p in plans] == [[], [("a", 0)], [], [("a", 1)], [], [("a", 2)], []]
    assert keyed(s) == {0: 0, 1: 1, 2: 2}  # blocks 0, 1, 2 end at 8, 16, 24
    # a whole prompt in one budget is cut once, at its last boundary
    s = make_scheduler(budget=64)
    plans = run(s, request("a", PROMPT))
    assert [p[:2] for p in plans] == [([("a", 0, 24)], [("a", 0)]), ([("a", 24, 3)], [])]
    assert keyed(s) == {2: 0}


def test_a_hit_ends_at_the_last_block_with_a_snapshot_and_restores_it():
    s = make_scheduler()
    run(s, request("a", PROMPT))  # a snapshot at 24 only
    # the same prompt and more: all three blocks cached, the snapshot at 24 starts its state
    plans = run(s, request("b", PROMPT + [1, 2, 3, 4, 5]))
    assert plans[0] == ([("b", 24, 8)], [("b", 1)], [("b", 0)])
    assert s.requests == {} and keyed(s) == {2: 0, 4: 1}  # b's own block 4 ends at 32
    # the first 20 tokens shared: two blocks cached, no snapshot at 16, so no hit; its first
    # chunk ends where the cached blocks do and leaves one there
    c = request("c", PROMPT[:20] + [9] * 10)
    plans = run(s, c)
    assert c.num_cached_tokens == 0
    assert [p[:2] for p in plans] == [([("c", 0, 16)], [("c", 2)]), ([("c", 16, 8)], [("c", 3)]), ([("c", 24, 6)], [])]
    # its save at 16 is keyed by the cached block 1 (its own copies, 5 and 6, went back), at 24 by its block 7
    assert keyed(s) == {2: 0, 4: 1, 1: 2, 7: 3}
    d = request("d", PROMPT[:20] + [8] * 10)
    plans = run(s, d)
    assert d.num_cached_tokens == 16 and plans[0][2] == [("d", 2)]


def test_decoding_keeps_its_latest_snapshot_and_the_next_turn_hits_it():
    """Blocks of 4, a 6-token prompt and 12 tokens out: decoding reaches 8, 12 and 16; each
    snapshot replaces the one before it, the prompt's at 4 stays."""
    s = make_scheduler(block_size=4)
    a = request("a", PROMPT[:6], max_tokens=12)
    plans = run(s, a)
    saves = [(i, save) for i, (_, save, _) in enumerate(plans) if save]
    assert saves == [(0, [("a", 0)]), (3, [("a", 1)]), (7, [("a", 2)]), (11, [("a", 1)])]  # 12 replaced 8's slot 1
    assert keyed(s) == {0: 0, 3: 1}  # blocks 0 and 3 end at 4 and 16
    # the next turn: the prompt, the answer (its last token has no KV yet) and more
    turn2 = request("b", a.all_token_ids + [1, 2, 3])
    plans = run(s, turn2)
    assert turn2.num_cached_tokens == 16 and plans[0][2] == [("b", 1)]


def test_a_small_pool_evicts_the_least_recently_used_snapshot():
    s = make_scheduler(num_snapshots=2)
    run(s, request("a", PROMPT))  # blocks 0-3, its snapshot at 24 keyed by block 2
    run(s, request("b", [5] + PROMPT[1:]))  # blocks 4-7
    assert keyed(s) == {2: 0, 6: 1}
    run(s, request("c", [6] + PROMPT[1:]))  # blocks 8, 9, 10, 3: takes a's slot
    assert keyed(s) == {6: 1, 10: 0}
    again = request("a2", PROMPT + [1])  # a's blocks are cached, its snapshot is gone: no hit
    plans = run(s, again)
    assert again.num_cached_tokens == 0 and plans[0] == ([("a2", 0, 24)], [("a2", 1)], [])
    assert keyed(s) == {10: 0, 2: 1}  # computed again over the cache's blocks (a's), b's snapshot gone


def test_a_snapshot_goes_with_its_block():
    """Seven blocks: b's first chunk (40 tokens, five blocks) takes a cached block of a's back,
    the one its snapshot is keyed by; the snapshot goes, and b's own takes the slot and the block."""
    s = make_scheduler(num_blocks=7)
    run(s, request("a", PROMPT))
    assert keyed(s) == {2: 0}
    b = request("b", [5] + PROMPT[1:] + [1] * 20)
    plans = run(s, b)
    assert plans[0][:2] == ([("b", 0, 40)], [("b", 0)])
    assert keyed(s) == {2: 0}  # block 2 ends b's 40 tokens now (its tail took a's block 1 too)
    assert s.prefix_cache.peek(PROMPT) == 8 and s.prefix_cache.peek(b.prompt_token_ids) == 40
    again = request("a2", PROMPT)
    run(s, again)
    assert again.num_cached_tokens == 0  # a's first block is cached, no snapshot ends there


def test_a_decode_step_whose_token_is_pending_keys_its_snapshot_once_the_token_is_known():
    """Async scheduling (schedule N+1, launch it, then update N): the step that ends at 8 feeds a
    token still pending; its block enters the cache, and its snapshot is keyed, when that token
    is known. A request aborted before then gives the slot back."""
    s = make_scheduler(block_size=4)
    for rid in ("a", "b"):
        s.add_request(request(rid, PROMPT[:7], max_tokens=8))
    launched = []

    def launch() -> SchedulerOutput:
        out = s.schedule()
        s.mark_launched(out)
        launched.append(out)
        return out

    def update() -> None:
        out = launched.pop(0)
        s.update(out, {c.request.request_id: [T] for c in out.chunks if c.samples})

    assert plan_of(launch()) == ([("a", 0, 4)], [("a", 0)], [])  # b waits for a's first block
    assert keyed(s) == {0: 0}
    assert plan_of(launch()) == ([("a", 4, 3), ("b", 4, 3)], [], [("b", 0)])  # b resumes from a's snapshot
    launch()  # the steps that end at 8, their tokens pending
    assert plan_of(launched[-1])[:2] == ([("a", 7, 1), ("b", 7, 1)], [("a", 1), ("b", 2)])
    assert s.snapshots.pending == {"a": [(8, 1)], "b": [(8, 2)]}
    s.abort("b")
    assert s.snapshots.pending == {"a": [(8, 1)]} and s.snapshots.held_for() == {"a"}
    update()
    update()  # the tails' tokens: 7 is known, the block ending at 8 cached, a's snapshot keyed
    assert s.snapshots.pending == {} and keyed(s) == {0: 0, 1: 1}  # a's block 1 holds 4 to 8
    while s.has_unfinished() or launched:
        if s.has_unfinished():
            launch()
        update()
    assert s.requests == {}
    check(s)
