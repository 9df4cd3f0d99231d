"""The host-memory tier under the prefix cache (--kv-offload-gib, scheduler/host_tier.py) on the
default model's batch-invariant path: a conversation whose first turn the small device pool
evicted gets its blocks back from host memory on the next turn, and its tokens and logprobs are
bit for bit the run without the tier (which recomputes them); the tier's LRU and pins; an abort
while blocks load leaves nothing held; the scheduling a copy stream gets (CUDA's), over the CPU's
copies."""

from __future__ import annotations

import pytest
from invariance import assert_same, results
from sampling import greedy

from ember import LLM
from ember.request import Request
from ember.scheduler.host_tier import HostKVTier, block_hashes

pytestmark = pytest.mark.slow

SMALL = dict(num_kv_blocks=24, max_model_len=320)  # 384 tokens of KV: one long conversation at a time
FIRST = ("You are a careful assistant. Here is a story to remember: " + "The lighthouse keeper counted ships "
         "every night, wrote their names in a blue book, and waved at the last one before dawn. " * 3)
OTHERS = [f"Write a list of {n} fruits and their colours, one per line, starting with apples. " * 12
          for n in ("ten", "twelve", "fifteen")]


@pytest.fixture(scope="module")
def engines(gguf_path, live_engines):
    plain = LLM(str(gguf_path), **SMALL, kv_offload_gib=0)  # (on CUDA the tier is on by default)
    block = plain.engine.runner.kv_bytes_per_block()
    tier = LLM(str(gguf_path), **SMALL, kv_offload_gib=64 * block / 2**30)  # 64 host blocks
    live_engines += [plain, tier]
    yield plain, tier
    for llm in (plain, tier):
        live_engines.remove(llm)


def conversation(llm: LLM) -> tuple[list, int]:
    """Turn 1, three other prompts that push its blocks out of the device pool, turn 2 (turn 1's
    prompt and answer and a question): every output, and turn 2's cached tokens."""
    tok, params = llm.get_tokenizer(), greedy(24, ignore_eos=True, logprobs=0)
    first = tok.encode(FIRST)
    outs = llm.generate([{"prompt_token_ids": first}], params)
    for other in OTHERS:
        outs += llm.generate([{"prompt_token_ids": tok.encode(other)}], params)
    second = first + list(outs[0].outputs[0].token_ids) + tok.encode(" Which colour was the book?")
    outs += llm.generate([{"prompt_token_ids": second}], params)
    return outs, outs[-1].num_cached_tokens


def test_an_evicted_turn_comes_back_from_host_memory_and_changes_nothing(engines):
    plain, tier = engines
    want, cached_plain = conversation(plain)
    got, cached_tier = conversation(tier)
    assert_same(results(got), results(want), "host tier")
    sched = tier.engine.scheduler
    assert cached_plain == 0  # without the tier the first turn was evicted and is recomputed
    assert cached_tier == sched.host_hit_tokens > 16 * 4 and sched.host.num_onloaded == cached_tier // 16
    assert sched.host.num_offloaded >= sched.host.num_onloaded
    stats, block = tier.engine.stats(), tier.engine.runner.kv_bytes_per_block()
    assert (stats.host_hit_tokens, stats.host_bytes_to_device, stats.host_bytes_to_host) == (
        cached_tier, sched.host.num_onloaded * block, sched.host.num_offloaded * block)  # /metrics reads these
    tier.engine.check_idle()
    tier.engine.prefix_cache.check_integrity()


def test_an_abort_while_blocks_load_holds_nothing(engines):
    plain, tier = engines
    conversation(tier)  # the tier holds the first turn's blocks, the pool the last prompts'
    core, tok = tier.engine, tier.get_tokenizer()
    for other in OTHERS:  # push the conversation out of the device pool again
        tier.generate([{"prompt_token_ids": tok.encode(other + " Again.")}], greedy(4))
    req = Request("loading", tok.encode(FIRST) + tok.encode(" And the ships?"), greedy(8))
    before = core.scheduler.host_hit_tokens
    core.add_request(req)
    core.step()  # admitted: its blocks are copied back in this step
    assert core.scheduler.host_hit_tokens > before
    core.abort_request("loading")
    while core.has_unfinished_requests():
        core.step()
    assert req.block_ids == []
    core.check_idle()
    core.prefix_cache.check_integrity()


def test_with_a_copy_stream_a_loading_request_waits_a_step_while_others_run(engines):
    """The scheduling CUDA's copy stream gets (Scheduler.copy_stream; runner/kv_copies.py), over the
    CPU's in-place copies: the step that admits a request whose blocks load runs the others without
    it, evictions into the tier run ahead of need with their blocks held until the step is
    collected, and every token is the plain engine's."""
    plain, tier = engines
    conversation(tier)
    core, tok, sched, pool = tier.engine, tier.get_tokenizer(), tier.engine.scheduler, tier.engine.block_pool
    for city in ("Oslo", "Lima", "Perth"):  # blocks new to the tier push the conversation out of the pool
        tier.generate([{"prompt_token_ids": tok.encode(f"Describe the weather in {city}, month by month. " * 9)}],
                      greedy(4))
    other = Request("other", tok.encode("Name three rivers and the seas they reach. " * 4), greedy(12, ignore_eos=True))
    loading = Request("loading", tok.encode(FIRST) + tok.encode(" Who waved?"), greedy(8, ignore_eos=True))
    sched.copy_stream = True
    try:
        core.add_request(other)
        core.step()
        core.add_request(loading)
        hits = sched.host_hit_tokens
        plan, held = step_by_hand(core)
        assert sched.host_hit_tokens > hits and plan.kv_onloads and plan.loads_ahead
        assert [c.request for c in plan.chunks] == [other] and loading.num_computed_tokens == loading.num_cached_tokens
        assert len(other.output_token_ids) == 2 and not loading.output_token_ids  # the other's token came
        while not held:  # until a step evicts ahead (fewer than 1 free block)
            _, held = step_by_hand(core)
        assert all(pool.ref_counts[b] == 0 for b in held)  # free once the step was collected
        while core.has_unfinished_requests():
            core.step()
    finally:
        sched.copy_stream = False
    want = [plain.generate([{"prompt_token_ids": r.prompt_token_ids}], r.sampling_params)[0] for r in (other, loading)]
    assert [list(o.outputs[0].token_ids) for o in want] == [other.output_token_ids, loading.output_token_ids]
    core.check_idle()
    core.prefix_cache.check_integrity()


def step_by_hand(core) -> tuple:
    """EngineCore's step by hand: schedule, launch, collect; the plan and the blocks it evicted ahead
    of need, each checked to be held (in use, out of the cache) until the step was collected."""
    plan = core.scheduler.schedule()
    held = [b for b, _ in plan.kv_offloads_held]
    assert all(core.block_pool.ref_counts[b] == 1 and not core.block_pool.cached[b] for b in held)
    core.in_flight.append(core.runner.launch(plan))
    core.scheduler.mark_launched(plan)
    core.finish_in_flight()
    return plan, held


def test_the_tier_keeps_the_most_recently_used_and_never_a_slot_a_plan_reads():
    tier = HostKVTier(2)
    tier.offload(11, block_id=5)
    tier.offload(22, block_id=6)
    tier.offload(11, block_id=7)  # held already: only marked recently used
    assert tier.take_offloads() == [(5, 0), (6, 1)]
    assert tier.lookup([22]) == [1]  # used, and pinned for the plan being built
    tier.offload(33, block_id=8)  # the least recently used unpinned slot goes: 11's
    assert tier.take_offloads() == [(8, 0)] and set(tier.slots) == {22, 33}
    tier.offload(44, block_id=9)  # 22 is pinned: 33's slot goes
    assert tier.take_offloads() == [(9, 0)] and set(tier.slots) == {22, 44}
    tier.new_plan()
    assert tier.lookup([99, 22]) == []  # a run from the first block only
    a, b = block_hashes([1, 2, 3, 4], 2, 2, None), block_hashes([1, 2, 3, 4], 2, 2, "salt")
    assert a[0] != b[0] and block_hashes([9, 9, 3, 4], 2, 2, None)[1] != a[1]  # salts and prefixes part keys


def test_blocks_evicted_by_sleep_are_not_kept_and_a_woken_engine_answers_as_before(engines):
    """/sleep drops the prefix cache, whose evicted blocks the tier would copy at the next step,
    from a pool that is freed by then: those copies are forgotten, so after wake_up nothing is
    loaded from slots that never got their bytes, and the answer is the first one."""
    _, tier = engines
    prompt = tier.get_tokenizer().encode("Name the planets in order, with one fact about each: " * 6)
    params = greedy(8, ignore_eos=True, logprobs=0)
    want = tier.generate([{"prompt_token_ids": prompt}], params)
    host, sched = tier.engine.scheduler.host, tier.engine.scheduler
    held, hits = set(host.slots), sched.host_hit_tokens
    tier.engine.sleep(1)
    assert host.offloads == [] and set(host.slots) <= held  # the prompt's blocks claim no slot (a full
    # tier may have given up older ones to them)
    tier.engine.wake_up()
    got = tier.generate([{"prompt_token_ids": prompt}], params)
    assert_same(results(got), results(want), "after sleep")
    assert sched.host_hit_tokens == hits and got[0].num_cached_tokens == 0


def test_dropped_offloads_free_their_slots():
    tier = HostKVTier(3)
    tier.offload(11, block_id=5)
    assert tier.take_offloads() == [(5, 0)]
    tier.offload(22, block_id=6)
    tier.offload(33, block_id=7)
    tier.drop_offloads()
    assert tier.offloads == [] and set(tier.slots) == {11} and tier.num_offloaded == 1
    tier.offload(44, block_id=8)  # a freed slot, not 11's
    assert tier.take_offloads() == [(8, 1)] and set(tier.slots) == {11, 44}
