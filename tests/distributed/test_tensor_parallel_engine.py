"""The engine at tensor_parallel_size > 1 (runner/tensor_parallel.py): one worker process
per rank over gloo. SmolLM2-135M (9 q / 3 KV heads) at TP=3 gives TP=1's greedy tokens and
guided choices, offline and through `ember serve`; a worker killed mid-run fails the engine
with an error that names it and leaves no process behind; Qwen3-Next at TP=2 gives TP=1's
greedy tokens through chunked prefill and prefix-cache hits (each rank its recurrent states and
their snapshots); a size the heads do not divide among, or a mixture of experts, is refused
before any worker starts."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
from processes import alive, descendants, gone
from qwen3_next_model import QWEN3_NEXT, save_qwen3_next

from ember import LLM, SamplingParams
from ember.runner.tensor_parallel import WorkerFailed
from ember.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)
CHOICE = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputsParams(
    choice=("blue", "green", "red")))


def _engine_args(**more):
    return dict(quantization="none", dtype="float32", num_kv_blocks=64) | more


@pytest.fixture(scope="module")
def reference(gguf_path):
    llm = LLM(str(gguf_path), **_engine_args())
    outs = llm.generate(PROMPTS, GREEDY)
    return ([o.outputs[0].token_ids for o in outs], llm.generate(["My favourite colour is"], CHOICE)[0].outputs[0].text,
            outs[0].outputs[0].text)


def test_three_ranks_give_one_process_tokens_and_a_killed_worker_fails_the_engine_by_name(gguf_path, reference):
    llm = LLM(str(gguf_path), **_engine_args(tensor_parallel_size=3))
    pids = [p.pid for p in llm.engine.runner.procs]
    try:
        assert len(pids) == 3 and all(alive(p) for p in pids)
        tokens, choice, _ = reference
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        assert llm.generate(["My favourite colour is"], CHOICE)[0].outputs[0].text == choice
        llm.check_idle()  # every finished request's KV blocks are back
        runner = llm.engine.runner
        assert runner.all_reduce == "gloo"
        runner.profile_steps = True  # --profile-steps: the engine's side of each step
        assert llm.generate(["Once upon a time"], GREEDY)[0].outputs[0].token_ids == tokens[2]
        runner.profile_steps = False
        assert sorted(runner.step_times) == ["schedule", "send", "steps", "update", "wait"]
        assert runner.step_times["steps"] == 24 and runner.step_times["wait"] > 0
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerFailed, match=r"^tensor-parallel worker (rank \d \(exit code -?\d+\)(, )?)+ while "
                                               r"(running|sending) a step") as failed:
            llm.generate(["Hello again"], SamplingParams(max_tokens=8, temperature=0))
        assert "rank 1 (exit code -9)" in str(failed.value)  # the others end with their failed collective
        with pytest.raises(WorkerFailed, match="the tensor-parallel workers are gone"):
            llm.generate(["and again"], SamplingParams(max_tokens=8, temperature=0))
    finally:
        llm.shutdown()
    assert gone(pids)  # the other two were stopped with it


def kill_mid_run(llm, prompt, rank: int, after_steps: int = 3) -> WorkerFailed:
    """Stream one long request, SIGKILL the worker of `rank` once `after_steps` outputs came
    back, and return the error the stream then raises."""
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    with pytest.raises(WorkerFailed) as failed:
        for i, _ in enumerate(llm.stream(prompt, params)):
            if i + 1 == after_steps:
                os.kill(llm.engine.runner.procs[rank].pid, signal.SIGKILL)
    return failed.value


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_drafters_run_sharded_on_three_ranks_and_give_one_process_tokens(gguf_path, reference, tmp_path, method):
    """An EAGLE-3 head (6 heads, 3 KV heads) and a tiny draft model (3 and 3), each split over the
    target's three ranks: the drafts come back from rank 0 and the tokens are TP=1's plain ones."""
    from ember.bench.dummy_eagle3 import head_config, random_head, save_head

    if method == "eagle3":
        config = head_config(576, 49152, 4096, None, heads=6, kv_heads=3, intermediate=192)
        save_head(tmp_path, config, random_head(config, seed=4, embed=False))
    else:
        transformers = pytest.importorskip("transformers")
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=3, tie_word_embeddings=True)).save_pretrained(tmp_path)
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3}
    llm = LLM(str(gguf_path), **_engine_args(tensor_parallel_size=3, speculative_config=spec))
    one = LLM(str(gguf_path), **_engine_args(speculative_config=spec))
    try:
        tokens, _, _ = reference
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == tokens
        counts = llm.engine.scheduler.spec
        assert counts.num_drafts > 20 and counts.num_draft_tokens > counts.num_drafts
        llm.check_idle()
        assert drafted(llm, PROMPTS[:2]) == drafted(one, PROMPTS[:2])  # the same drafts as one process's
    finally:
        llm.shutdown()
        one.shutdown()


def drafted(llm: LLM, prompts: list[str]) -> list[tuple[int, list[int]]]:
    """Every (step, drafts) the engine proposed for the prompts, stepped by hand."""
    from ember.request import Request

    core, tok = llm.engine, llm.get_tokenizer()
    reqs = [Request(f"d{i}", tok.encode(p), GREEDY) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    out, step = [], 0
    while core.has_unfinished_requests():
        core.step()
        out += [(step, list(r.draft_token_ids)) for r in reqs if r.draft_token_ids]
        step += 1
    return out


def test_a_worker_killed_mid_run_with_steps_in_flight_fails_with_the_error_that_names_it(gguf_path):
    # async scheduling (the GPU's default) keeps a step in flight: the cleanup's collect of it must
    # not replace the error that names the rank with a later one
    llm = LLM(str(gguf_path), **_engine_args(tensor_parallel_size=3, async_scheduling=True))
    pids = [p.pid for p in llm.engine.runner.procs]
    try:
        assert llm.engine.max_in_flight == 1
        error = kill_mid_run(llm, PROMPTS[2], rank=2)
        assert re.match(r"tensor-parallel worker (rank \d \(exit code -?\d+\)(, )?)+ while (running|sending) a step",
                        str(error)), error
        assert "rank 2 (exit code -9)" in str(error)
        assert not llm.engine.in_flight  # the steps in flight went with the workers
    finally:
        llm.shutdown()
    assert gone(pids)


def test_qwen3_next_at_two_ranks_carries_each_ranks_recurrent_state_through_chunks_and_cache_hits(tmp_path):
    """Qwen3-Next's gated DeltaNet split by key heads: each rank keeps its heads' recurrent state
    in a slot a request, through 5-token chunks of prefill and decode steps, and its snapshots,
    which the same prompts then resume from (their whole 8-token blocks from the prefix cache):
    the greedy tokens of one process, both times."""
    save_qwen3_next(QWEN3_NEXT, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7],
                                                 [300] + list(range(1, 27)))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(num_kv_blocks=64, block_size=8, max_model_len=256, dtype="float32", max_num_batched_tokens=5)
    one = LLM(str(tmp_path), **engine)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    one.shutdown()
    llm = LLM(str(tmp_path), **(engine | dict(tensor_parallel_size=2)))
    try:
        runs = [llm.generate(prompts, params) for _ in range(2)]
        assert [[o.outputs[0].token_ids for o in outs] for outs in runs] == [expected, expected]
        assert [[o.num_cached_tokens for o in outs] for outs in runs] == [[0, 0, 0], [8, 0, 24]]
        llm.check_idle()
    finally:
        llm.shutdown()


def test_sizes_the_heads_or_experts_do_not_divide_among_are_refused_before_any_worker(gguf_path, tmp_path):
    with pytest.raises(ValueError, match=r"9 attention heads \(3 KV heads\) do not divide among 2 tensor-parallel "
                                         r"ranks: use a tensor_parallel_size among \[1, 3"):
        LLM(str(gguf_path), **_engine_args(tensor_parallel_size=2))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 66, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128}))
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(moe_intermediate_size\) \(66\) does not "
                                         r"divide among 4 tensor-parallel ranks"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1; got 0"):
        LLM(str(gguf_path), tensor_parallel_size=0)


def test_ember_serve_at_three_ranks_answers_and_stops_with_its_workers(gguf_path, tmp_path, reference):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from servers import KEY, MODEL, Server

    s = Server(gguf_path, tmp_path / "tp.log", "--api-key", KEY, "--tensor-parallel-size", "3",
               "--num-kv-blocks", "64", "--disable-custom-all-reduce")
    try:
        s.wait_ready()
        workers = descendants(s.proc.pid)  # the engine core's process, and its rank workers below it
        assert len(workers) >= 4, s.log_tail()
        assert "3 ranks ready, 64 KV blocks each; all-reduce: gloo" in (tmp_path / "tp.log").read_text()
        answer = s.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
        assert answer.choices[0].text == reference[2]
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()
    assert gone(workers)
