"""KV copies between the device pool and host slots (runner/kv_copies.py): on the CPU each block's
bytes land in its slot and come back to another block, in any cache dtype, a draft model's cache
beside the target's moving with it, the tier's buffers made in the background (the first copy into
them waits); `-m gpu`: on CUDA's
copy stream, the host tier and swap give a big pool's greedy tokens (deterministic mode), a step
with a load in flight runs the other requests (the loading one from the next step on), an abort
while its blocks load leaves nothing held, and a swap-out's blocks stay held (nobody on the device
waits for their copies) until its step is collected, an abort meanwhile included."""

from __future__ import annotations

import threading

import pytest
import torch

from ember.request import Request, RequestStatus
from ember.runner import kv_copies
from ember.runner.kv_copies import HostSlots, KVCopies, copy_blocks, slot_runs
from ember.sampling_params import SamplingParams
from ember.scheduler.scheduler import SchedulerOutput


def test_slot_runs():
    assert slot_runs([4, 5, 6, 2, 3, 9]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1)]
    assert slot_runs([]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_go_to_their_slots_and_come_back(dtype):
    # planes, layers, blocks, tokens, heads, dims: the target's, and a drafter's over the same block ids
    caches = [torch.randn(2, 3, 6, 4, 2, 8).to(dtype), torch.randn(2, 1, 6, 4, 1, 16).to(dtype)]
    copies = KVCopies(caches, tier_slots=5, swap_slots=3)
    want = [c.clone() for c in caches]
    # outs: blocks 1, 2 to tier slots 3, 4 (one run), held block 5 to slot 0; block 0 to swap slot 2
    assert copies.launch(SchedulerOutput(kv_offloads=[(1, 3), (2, 4)], kv_offloads_held=[(5, 0)],
                                         swap_outs=[(0, 2)]), caches).load_seconds is None
    for c in caches:
        c.zero_()
    # ins: tier slots 4, 0 to blocks 0, 3; swap slot 2 to block 5
    issued = copies.launch(SchedulerOutput(kv_onloads=[(4, 0), (0, 3)], swap_ins=[(2, 5)]), caches)
    assert copies.collect(issued) >= 0
    for cache, before in zip(caches, want):
        raw, ref = cache.view(torch.uint8), before.view(torch.uint8)
        for dst, src in ((0, 2), (3, 5), (5, 0)):
            assert torch.equal(raw[:, :, dst], ref[:, :, src])
        assert not raw[:, :, [1, 2, 4]].any()  # nothing else written
    assert copies.launch(SchedulerOutput(), caches) is None


def test_the_tier_buffers_are_made_in_the_background_and_the_first_tier_copy_waits_for_them(monkeypatch):
    """start_host_tier (the runner calls it at the end of its start-up) makes the tier's buffers in a
    thread; a plan without tier copies does not wait for it, the first one with them does."""
    release, made = threading.Event(), []
    real = KVCopies.host_blocks

    def slow(self, kv_cache, n):  # the tier's 4 slots take until `release`; the swap space's 2 come at once
        if n == 4:
            assert threading.current_thread() is not threading.main_thread()
            assert release.wait(10)
            made.append(n)
        return real(self, kv_cache, n)

    monkeypatch.setattr(KVCopies, "host_blocks", slow)
    caches = [torch.randn(2, 3, 6, 4, 2, 8)]
    want = caches[0].clone()
    copies = KVCopies(caches, tier_slots=4, swap_slots=2)
    copies.start_host_tier()
    copies.launch(SchedulerOutput(swap_outs=[(1, 0)]), caches)  # swap only: no wait
    assert made == []
    threading.Timer(0.2, release.set).start()
    copies.launch(SchedulerOutput(kv_offloads=[(2, 3)]), caches)  # waits for the tier's buffers
    assert made == [4]
    caches[0].zero_()
    copies.launch(SchedulerOutput(kv_onloads=[(3, 4)], swap_ins=[(0, 5)]), caches)
    assert torch.equal(caches[0][:, :, 4], want[:, :, 2]) and torch.equal(caches[0][:, :, 5], want[:, :, 1])
    assert not caches[0][:, :, :4].any()


def test_without_start_host_tier_the_first_tier_copy_makes_the_buffers():
    caches = [torch.randn(2, 1, 3, 4, 1, 8)]
    copies = KVCopies(caches, tier_slots=2, swap_slots=0)
    assert copies.tier[0].shape == (2, 2, 1, 4, 1, 32) and copies.swap == [None]
    assert KVCopies(caches, tier_slots=0, swap_slots=0).tier == [None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_block_copies_in_batches_equal_one_copy_a_block(dtype, monkeypatch):
    caches = [torch.randn(2, 3, 8, 4, 2, 8).to(dtype), torch.randn(2, 1, 8, 4, 1, 16).to(dtype)]
    pairs = [(1, 4), (2, 0), (5, 3), (1, 7), (6, 2)]  # sources held, destinations fresh: disjoint
    want = [c.clone() for c in caches]
    for c in want:
        for src, dst in pairs:
            c[:, :, dst] = c[:, :, src]
    monkeypatch.setattr(kv_copies, "STAGING_BYTES", 2 * caches[0].view(torch.uint8)[:, :, 0].numel())
    copy_blocks(caches, pairs)  # batches of two blocks, one of the target cache's
    for cache, ref in zip(caches, want):
        assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


# -- on CUDA (-m gpu) ------------------------------------------------------------------------

CONFIG = "benchmarks/configs/qwen3-0.6b"
ARGS = dict(load_format="dummy", dtype="bfloat16", seed=0, max_num_seqs=8, deterministic=True, block_size=16,
            max_model_len=512)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(100, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                               _greedy(n))]


@pytest.fixture(scope="module")
def cuda_engines():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ember import LLM

    big = LLM(CONFIG, num_kv_blocks=256, kv_offload_gib=0, **ARGS)  # (the tier is on by default on CUDA)
    block = big.engine.runner.kv_bytes_per_block()
    tier = LLM(CONFIG, num_kv_blocks=40, kv_offload_gib=128 * block / 2**30, **ARGS)
    swap = LLM(CONFIG, num_kv_blocks=40, preemption_mode="swap", swap_space=128 * block / 2**30, kv_offload_gib=0,
               **ARGS)
    yield big, tier, swap


def _evict(llm, seed: int) -> None:
    """Three prompts, new to it, that fill the small pool with other blocks (earlier turns' go to host memory)."""
    _tokens(llm, [_prompt(seed + i, 500) for i in range(3)], 4)


@pytest.mark.gpu
def test_the_host_tier_and_swap_on_the_copy_stream_give_a_big_pools_tokens(cuda_engines):
    big, tier, swap = cuda_engines
    first = _prompt(1, 400)
    turns = {}
    for name, llm in (("big", big), ("tier", tier)):
        out = _tokens(llm, [first], 24)[0]
        _evict(llm, 100)
        second = first + out + _prompt(2, 40)
        turns[name] = out, _tokens(llm, [second, _prompt(3, 60)], 24)
    assert turns["tier"] == turns["big"]
    sched = tier.engine.scheduler
    assert sched.host_hit_tokens >= 400 // 16 * 16 and tier.engine.kv_loads > 0 and tier.engine.kv_load_seconds > 0
    tier.engine.check_idle()
    prompts = [_prompt(10 + i, 150) for i in range(4)]  # four that grow past the 40 blocks: preemptions
    assert _tokens(swap, prompts, 120) == _tokens(big, prompts, 120)
    assert swap.engine.scheduler.num_swapped > 0 and swap.engine.kv_loads > 0
    swap.engine.check_idle()


@pytest.mark.gpu
def test_a_step_with_a_load_in_flight_runs_the_others_and_an_abort_then_holds_nothing(cuda_engines):
    big, tier, _ = cuda_engines
    core = tier.engine
    first = _prompt(20, 400)
    _tokens(tier, [first], 4)
    for abort in (False, True):
        _evict(tier, 200 + 10 * abort)
        other = Request(f"other-{abort}", _prompt(21, 100), _greedy(16))
        loading = Request(f"loading-{abort}", first + _prompt(22, 30), _greedy(8))
        core.add_request(other)
        while not other.output_token_ids:
            core.step()
        hits = core.scheduler.host_hit_tokens
        core.add_request(loading)
        core.step()  # admits it: its blocks load on the copy stream while the others' step runs
        plan = core.scheduler.in_flight[-1]  # (async scheduling: launched, not yet updated)
        assert core.scheduler.host_hit_tokens > hits and plan.kv_onloads and plan.loads_ahead
        assert [c.request for c in plan.chunks] == [other]  # the other's token comes in this step
        assert loading.status is RequestStatus.RUNNING and loading.num_computed_tokens == loading.num_cached_tokens
        if abort:
            core.abort_request(loading.request_id)
        while core.has_unfinished_requests():
            core.step()
        assert other.output_token_ids == _tokens(big, [other.prompt_token_ids], 16)[0]
        if not abort:
            assert loading.output_token_ids == _tokens(big, [loading.prompt_token_ids], 8)[0]
        core.check_idle()


@pytest.mark.gpu
def test_swap_outs_hold_their_blocks_until_collected_and_an_abort_meanwhile_holds_nothing(cuda_engines):
    big, _, swap = cuda_engines
    core, sched = swap.engine, swap.engine.scheduler
    prompts = [_prompt(30 + i, 150) for i in range(4)]
    reqs = [Request(f"swap-mid-{i}", p, _greedy(120)) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    gone = None
    while core.has_unfinished_requests():
        core.step()
        plan = sched.in_flight[-1] if sched.in_flight else None  # (async scheduling: launched, not yet updated)
        if gone is None and plan is not None and plan.swap_outs:
            assert set(b for b, _ in plan.swap_outs) <= set(plan.free_when_collected)
            gone = next(r for r in reqs if r.swapped is not None and set(r.swapped[0]) <= {s for _, s in plan.swap_outs})
            core.abort_request(gone.request_id)
    assert gone is not None and sched.swap.num_free == sched.swap.num_slots
    want = _tokens(big, [r.prompt_token_ids for r in reqs if r is not gone], 120)
    assert [r.output_token_ids for r in reqs if r is not gone] == want
    core.check_idle()


def test_host_slots_pin_what_was_asked_in_pieces_under_powers_of_two():
    slots = HostSlots((3, 5), 10, pin=False)  # 15 bytes a slot, 150 asked: one buffer would pin 256
    assert [len(p) for p in slots.pieces] == [8, 1, 1] and slots.starts == [0, 8, 9]
    # what torch's caching host allocator pins for each piece: the next power of two of its bytes
    assert [1 << (p.numel() - 1).bit_length() for p in slots.pieces] == [128, 16, 16]
    assert slots.shape == (10, 3, 5)
    spans = slots.spans(6, 4)  # slots 6 .. 9 cross both boundaries
    assert [(v.data_ptr(), len(v), j) for v, j in spans] == [
        (slots.pieces[0][6:].data_ptr(), 2, 0), (slots.pieces[1].data_ptr(), 1, 2), (slots.pieces[2].data_ptr(), 1, 3)]
    assert [len(HostSlots((1,), n, pin=False).pieces) for n in (1, 2, 3, 4, 7, 8, 1000)] == [1, 1, 2, 1, 3, 1, 6]
