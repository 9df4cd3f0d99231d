"""The plan diff (runner/plan_diff.py): the tensor-parallel workers' mirrors of the
running requests, fed each step only what changed, hold exactly what the engine's requests
hold when the runner reads them (and a step's preempted requests are theirs). Checked on every step of a real engine (the default model)
through preemption, prefix-cache hits, n > 1 forks and async scheduling's pending tokens;
then the same engine shape with its one rank in a worker process gives the in-process
tokens and guided choice (the masks travel in the message after the plan), with speculative
decoding's drafts too."""

from __future__ import annotations

import pickle

import pytest

from ember import LLM, SamplingParams
from ember.runner.plan_diff import PlanDecoder, PlanEncoder
from ember.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

SHARED = "You are a helpful assistant who answers in one short sentence. " * 3
PROMPTS = [SHARED + q for q in ("What is the capital of France?", "Name a colour.", "Count to five.",
                               "What is two plus two?", "Say hello.", "Name a fruit.")]
CHOICE = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(
    choice=("blue", "green", "red")))


def _mirror_of(req) -> tuple:
    return (req.request_id, req.prompt_token_ids, req.output_token_ids, req.block_ids, req.num_computed_tokens,
            req.num_pending_tokens, req.sampling_params, req.num_samples_to_draw)


def test_mirrors_hold_what_the_engine_holds_at_every_step(gguf_path):
    # 12 blocks of 16 for four ~45-token prompts growing by 40: preemption is certain
    llm = LLM(str(gguf_path), num_kv_blocks=12, max_num_seqs=4, enable_prefix_caching=True, async_scheduling=True,
              seed=0)
    runner, encoder, decoder = llm.engine.runner, PlanEncoder(), PlanDecoder()
    launch, release = runner.launch, runner.release
    seen = {"chunks": 0, "whole": 0, "tail": 0, "pending": 0, "preempted": 0, "bytes": []}

    def checked_launch(plan, fill=None):
        diff = encoder.encode(plan)
        data = pickle.dumps(diff)
        seen["bytes"].append(len(data))
        mirrored = decoder.decode(pickle.loads(data))
        assert len(mirrored.chunks) == len(plan.chunks) and mirrored.block_copies == plan.block_copies
        assert (mirrored.state_restores, mirrored.state_saves) == (plan.state_restores, plan.state_saves)
        assert [r.request_id for r in mirrored.preempted] == [r.request_id for r in plan.preempted]
        seen["preempted"] += len(plan.preempted)
        for chunk, mirror in zip(plan.chunks, mirrored.chunks):
            assert (mirror.num_new_tokens, mirror.start, mirror.samples, mirror.draft_token_ids) == (
                chunk.num_new_tokens, chunk.start, chunk.samples, chunk.draft_token_ids)
            assert _mirror_of(mirror.request) == _mirror_of(chunk.request)
        for request_id, *_, blocks, whole, drafts in diff.chunks:
            seen["whole"] += whole
            seen["tail"] += bool(blocks) and not whole
        seen["chunks"] += len(plan.chunks)
        seen["pending"] += sum(c.request.num_pending_tokens > 0 for c in plan.chunks)
        return launch(plan, fill)

    def checked_release(request_id):
        encoder.forget(request_id)
        decoder.forget(request_id)
        release(request_id)

    runner.launch, runner.release = checked_launch, checked_release
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True))
    outs += llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=2))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs[:6]) and all(len(o.outputs) == 3 for o in outs[6:])
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.prefix_cache_hits > 0
    assert seen["whole"] > 0 and seen["tail"] > 0 and seen["pending"] > 0 and seen["preempted"] > 0, seen
    assert encoder.sent == {} and decoder.requests == {}, "a finished request's mirror was kept"
    # a decode step of four requests is a few hundred bytes, whatever their length
    assert min(seen["bytes"]) < 600, seen["bytes"]


def test_one_rank_in_a_worker_process_gives_the_engine_process_tokens(gguf_path):
    prompts = PROMPTS[:3]
    greedy = SamplingParams(max_tokens=16, temperature=0)
    here = LLM(str(gguf_path), num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in here.generate(prompts, greedy)]
    expected_choice = here.generate(["My favourite colour is"], CHOICE)[0].outputs[0].text
    here.shutdown()
    llm = LLM(str(gguf_path), num_kv_blocks=64, distributed_executor_backend="mp")
    try:
        assert len(llm.engine.runner.procs) == 1
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
        assert llm.generate(["My favourite colour is"], CHOICE)[0].outputs[0].text == expected_choice
        assert expected_choice in ("blue", "green", "red")
    finally:
        llm.shutdown()


def test_drafts_reach_a_worker_process_and_roll_back_there(gguf_path):
    """Speculative decoding with the rank in a worker: the drafts travel in the plan, a rollback
    replaces the block list; the tokens are the in-process engine's without speculation."""
    prompts = ["Repeat: one two three four five six. Repeat: one two three", "Say hello."]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    here = LLM(str(gguf_path), num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in here.generate(prompts, greedy)]
    here.shutdown()
    llm = LLM(str(gguf_path), num_kv_blocks=64, distributed_executor_backend="mp",
              speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
        counts = llm.engine.scheduler.spec
        assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
    finally:
        llm.shutdown()
