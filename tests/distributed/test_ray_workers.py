"""Tensor-parallel workers as Ray actors (runner/ray_workers.py) on a simulated two-node Ray
cluster on this machine (ray.cluster_utils.Cluster: two raylets, gloo between the ranks):
SmolLM2-135M at TP=3 over both nodes gives one process's greedy tokens; an actor that dies
fails the engine by rank; the engine's actors and placement group go with it. The cluster
gets a temp dir of its own and is stopped by its handle (never `ray stop`)."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.runner.tensor_parallel import WorkerFailed

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0)
ARGS = dict(quantization="none", dtype="float32", num_kv_blocks=64)


def test_three_ranks_over_two_ray_nodes_give_one_process_tokens(gguf_path, two_nodes):
    from ray.util import placement_group_table

    want = [o.outputs[0].token_ids for o in LLM(str(gguf_path), **ARGS).generate(PROMPTS, GREEDY)]
    llm = LLM(str(gguf_path), **ARGS, tensor_parallel_size=3, distributed_executor_backend="ray")
    runner = llm.engine.runner
    group_id = runner.group.id
    try:
        nodes = placement_group_table(runner.group)["bundles_to_node_id"]
        assert len(nodes) == 3 and len(set(nodes.values())) == 2  # PACK: two ranks on the head, one on the other
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        llm.check_idle()
        ray.kill(runner.actors[2])
        with pytest.raises(WorkerFailed, match=r"^tensor-parallel worker (rank \d, )*rank 2(, rank \d)* \(a Ray "
                                               r"actor\) while (running|sending) a step"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
        with pytest.raises(WorkerFailed, match="the tensor-parallel workers are gone"):
            llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    finally:
        llm.shutdown()
    assert runner.actors == [] and placement_group_table()[group_id.hex()]["state"] == "REMOVED"


def test_a_group_the_cluster_cannot_place_is_refused(gguf_path, two_nodes, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    from ember.runner import ray_workers

    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_S", 2)
    held = placement_group([{"CPU": 2}])  # leaves one of the three CPUs free
    assert held.wait(timeout_seconds=60)
    try:
        with pytest.raises(ValueError, match=r"^the Ray cluster cannot place 3 workers of \{'CPU': 1(\.0)?\} within 2 s: it has "
                                             r"\{'CPU': 1\.0, 'GPU': 0\.0\} free"):
            LLM(str(gguf_path), **ARGS, tensor_parallel_size=3, distributed_executor_backend="ray")
    finally:
        remove_placement_group(held)
