"""Speculative decoding in the scheduler: a decode chunk carries the request's drafts as extra
query tokens, within the budget, max_tokens, max_model_len and the free blocks; the update keeps
the run its rows agree with and rolls back the rest, block ids and prefix cache exactly."""

from __future__ import annotations

from test_scheduler import EOS, check_invariants, make_request

from ember.config import EngineConfig
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import make_prefix_cache
from ember.scheduler.scheduler import Scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def make(num_blocks: int = 16, budget: int = 64, max_model_len: int = 64) -> Scheduler:
    pool = BlockPool(num_blocks)
    return Scheduler(pool, EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=budget,
                                        max_model_len=max_model_len, speculative_config=NGRAM),
                     make_prefix_cache(True, pool, 4))


def prefill(s: Scheduler, rid: str = "a", prompt: int = 6, max_tokens: int = 10, first: int = 50):
    req = make_request(rid, prompt, max_tokens)
    s.add_request(req)
    out = s.schedule()
    s.update(out, {rid: [first]})
    return req


def test_drafts_ride_the_decode_chunk_and_rejected_ones_give_their_blocks_back():
    s = make()
    req = prefill(s)
    assert (req.block_ids, req.num_computed_tokens, req.output_token_ids) == ([0, 1], 6, [50])
    req.draft_token_ids = [51, 52, 53]
    out = s.schedule()
    check_invariants(s, out)
    (chunk,) = out.chunks
    assert (chunk.num_new_tokens, chunk.draft_token_ids, chunk.start, chunk.samples) == (4, [51, 52, 53], 6, True)
    assert req.block_ids == [0, 1, 2]  # positions 6..9: the last token and three drafts
    # rows: 51 agrees, 60 differs from draft 52 (the rest is never read)
    stepped, finished = s.update(out, {"a": [51, 60, 61, 62]})
    assert stepped == [req] and not finished
    assert req.output_token_ids == [50, 51, 60]
    assert req.num_computed_tokens == 8  # 6 + the last token + one accepted draft
    assert req.block_ids == [0, 1] and s.pool.ref_counts[2] == 0  # block 2 held only rejected drafts
    assert req.num_blocks_in_cache == 2  # the full blocks of known, computed tokens
    assert (s.spec.num_drafts, s.spec.num_draft_tokens, s.spec.num_accepted_tokens,
            s.spec.accepted_per_position) == (1, 3, 1, [1, 0, 0])
    check_invariants(s)
    # every draft accepted: the row after the last one adds its own token
    req.draft_token_ids = [70, 71]
    out = s.schedule()
    assert out.chunks[0].num_new_tokens == 3 and req.block_ids == [0, 1, 3]  # (a freed block queues last)
    s.update(out, {"a": [70, 71, 72]})
    assert req.output_token_ids == [50, 51, 60, 70, 71, 72] and req.num_computed_tokens == 11
    assert req.block_ids == [0, 1, 3] and req.num_blocks_in_cache == 2
    assert s.spec.accepted_per_position == [2, 1, 0] and s.spec.num_accepted_tokens == 3


def test_drafts_are_cut_to_max_tokens_max_model_len_budget_and_free_blocks():
    s = make()
    req = prefill(s, max_tokens=3)
    req.draft_token_ids = [1, 2, 3, 4]
    out = s.schedule()  # one output token so far, three at most: the last token and one draft
    assert out.chunks[0].draft_token_ids == [1]
    s.update(out, {"a": [1, 9]})
    assert req.output_token_ids == [50, 1, 9] and req.status.is_finished and req.finish_reason == "length"

    s = make(max_model_len=10)
    req = prefill(s, prompt=6, max_tokens=None)
    req.draft_token_ids = [1, 2, 3, 4]
    assert s.schedule().chunks[0].draft_token_ids == [1, 2]  # 7 tokens known: 3 more fit, the last a row's own

    s = make(budget=7)
    req = prefill(s)
    s.add_request(make_request("b", 4, 4))
    req.draft_token_ids = [1, 2, 3, 4]
    out = s.schedule()  # a's own token, b's prompt, then drafts in what is left
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 3), ("b", 4)]
    assert out.chunks[0].draft_token_ids == [1, 2]

    s = make(num_blocks=5, max_model_len=20)
    req, other = make_request("a", 6, None), make_request("b", 8, None)
    other.prompt_token_ids = [200 + i for i in range(8)]  # no block in common with a's
    s.add_request(req)
    s.add_request(other)
    s.update(s.schedule(), {"a": [50], "b": [50]})
    assert (req.block_ids, other.block_ids) == ([0, 1], [2, 3])  # b's next token needs a third
    req.draft_token_ids = [1, 2, 3, 4, 5, 6, 7]
    out = s.schedule()  # b takes the last free block: a's drafts fit in its own block 1 (positions 6, 7)
    assert not out.preempted
    assert [(c.request.request_id, c.draft_token_ids) for c in out.chunks] == [("a", [1]), ("b", [])]
    assert req.block_ids == [0, 1] and s.pool.num_available == 0


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    s = make()
    req = prefill(s)
    req.draft_token_ids = [5, EOS, 6]
    out = s.schedule()
    _, finished = s.update(out, {"a": [5, EOS, 6, 7]})
    assert finished == [req] and req.output_token_ids == [50, 5, EOS] and req.finish_reason == "stop"
    assert req.block_ids == [] and s.pool.num_in_use == 0
    # positions 0..7 (the prompt, 50 and the accepted 5) have their KV: two full blocks, cached as without
    # speculation (the stop token's KV is never needed; the rows after it never count)
    assert s.prefix_cache.match(req.all_token_ids, 8, None).block_ids == [0, 1]


def test_preemption_drops_the_drafts():
    s = make(num_blocks=4, max_model_len=16)
    a, b = make_request("a", 8, None), make_request("b", 8, None)
    b.prompt_token_ids = [200 + i for i in range(8)]
    s.add_request(a)
    s.add_request(b)
    s.update(s.schedule(), {"a": [50], "b": [50]})
    assert (a.block_ids, b.block_ids, s.pool.num_available) == ([0, 1], [2, 3], 0)
    a.draft_token_ids, b.draft_token_ids = [1, 2], [3, 4]
    out = s.schedule()  # a's next token needs a block: b (the newest) is preempted, and its drafts go
    assert [r.request_id for r in out.preempted] == ["b"] and b.draft_token_ids == []
    assert out.chunks[0].request is a and out.chunks[0].draft_token_ids == []  # no drafts in a step that preempts


def test_lookahead_blocks_come_from_free_blocks_only_and_stop_at_max_model_len():
    s = make(num_blocks=4, max_model_len=14)
    req = prefill(s)  # 6 prompt tokens computed in blocks [0, 1]; its first output token pending
    s.reserve_lookahead(req, 3)  # positions 6..8: block 2
    assert req.block_ids == [0, 1, 2]
    s.reserve_lookahead(req, 20)  # as far as max_model_len: 14 tokens, block 3
    assert req.block_ids == [0, 1, 2, 3] and s.pool.num_available == 0
    other = make(num_blocks=3)
    busy = prefill(other, max_tokens=2)  # blocks [0, 1]
    other.pool.allocate(1)  # someone else holds the last block
    other.reserve_lookahead(busy, 4)
    assert busy.block_ids == [0, 1] and other.num_preemptions == 0  # nothing free: no block, nobody preempted
