"""`ember serve --data-parallel-size 2 --data-parallel-backend ray` on a simulated two-node Ray
cluster (the `two_nodes` fixture: two raylets on this machine). Through the real `openai`
client the answers equal the offline engine's; the replicas run on different nodes and both
serve; a replica whose actor dies is out of rotation; after SIGTERM, or when the command is
killed, no replica, actor or placement group is left. A cluster too small for the replicas
asked for is refused with a clear error, and a replica that cannot start ends the command."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from processes import alive
from servers import KEY, MODEL, Server

from ember import LLM, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colours are"]
RAY_ARGS = ("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--num-kv-blocks", "64")


@pytest.fixture
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a replica's bundle is one CPU, whatever this host has


def _wait_released(pids: list[int], cpus: float) -> None:
    """Until none of `pids` runs and the cluster has `cpus` CPUs free again (no actor or group holds one)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids) and ray.available_resources().get("CPU") == cpus:
            break
        time.sleep(0.2)
    assert [p for p in pids if alive(p)] == []
    assert ray.available_resources().get("CPU") == cpus


def _replica_groups() -> dict[str, dict]:
    """The cluster's SPREAD placement groups (the replicas'), by id."""
    from ray.util import placement_group_table

    return {i: g for i, g in placement_group_table().items() if g["strategy"] == "SPREAD"}


def test_two_replicas_on_two_nodes_answer_as_one_engine_and_stop_cleanly(gguf_path, tmp_path, two_nodes,
                                                                       one_thread):
    reference = LLM(str(gguf_path), quantization="none", dtype="float32", num_kv_blocks=64)
    want = [o.outputs[0] for o in reference.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]
    del reference
    s = Server(gguf_path, tmp_path / "dp.log", "--api-key", KEY, *RAY_ARGS)
    try:
        s.wait_ready(600)
        client = s.client()
        for prompt, out in zip(PROMPTS, want):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
            assert (r.choices[0].text, r.usage.completion_tokens) == (out.text, len(out.token_ids))
        workers = httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"]
        assert [w["healthy"] for w in workers] == [True, True] and sum(w["routed"] for w in workers) == 4
        assert min(w["routed"] for w in workers) >= 1, workers  # both replicas served
        nodes = {w["ray_node_id"] for w in workers}
        assert len(nodes) == 2 and nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        [group] = [g for g in _replica_groups().values() if g["state"] == "CREATED"]
        assert sorted(group["bundles_to_node_id"].values()) == sorted(nodes)
        pids = [p for w in workers for p in (w["pid"], w["actor_pid"])]
        assert all(alive(p) for p in pids)
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()
    _wait_released(pids, 3.0)
    assert _replica_groups()[group["placement_group_id"]]["state"] == "REMOVED"


def test_a_dead_replica_is_out_and_a_killed_command_leaves_none_behind(gguf_path, tmp_path, two_nodes, one_thread):
    s = Server(gguf_path, tmp_path / "dp.log", *RAY_ARGS)
    try:
        s.wait_ready(600)
        workers = httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"]
        pids = [p for w in workers for p in (w["pid"], w["actor_pid"])]
        assert len(pids) == 4 and all(alive(p) for p in pids)
        os.kill(workers[0]["actor_pid"], signal.SIGKILL)  # a replica's actor dies: its server goes with it
        deadline = time.monotonic() + 30
        while alive(workers[0]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(workers[0]["pid"])
        deadline = time.monotonic() + 30  # the router's health check (every 5 s) takes it out
        while httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"][0]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = s.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2  # the other replica answers
        stats = httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"]
        assert [(w["healthy"], w["routed"]) for w in stats] == [(False, 0), (True, 1)]
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(30)
        _wait_released(pids, 3.0)  # Ray ends the actors whose owner died; their servers die with them
    finally:
        s.stop()


def test_replicas_the_cluster_cannot_place_are_refused(two_nodes, monkeypatch, one_thread):
    from ember.server import ray_replicas

    monkeypatch.setattr(ray_replicas, "PLACEMENT_TIMEOUT_S", 2)
    before = set(_replica_groups())
    with pytest.raises(ValueError, match=r"^the Ray cluster cannot place 4 data-parallel replicas of \{'CPU': 1\} "
                                         r"within 2 s: it has \{'CPU': 3\.0, 'GPU': 0\.0\} free; lower "
                                         r"--data-parallel-size \(or OMP_NUM_THREADS"):
        ray_replicas.run_ray_replicas(["serve", "unused.gguf"], 4, "cpu", 1, "127.0.0.1", 0, "info")
    [new] = [g for i, g in _replica_groups().items() if i not in before]
    assert new["state"] == "REMOVED" and len(new["bundles"]) == 4
    assert ray.available_resources().get("CPU") == 3.0


def test_a_replica_that_cannot_start_ends_the_command_with_its_error(gguf_path, tmp_path, two_nodes, one_thread):
    s = Server(gguf_path, tmp_path / "dp.log", *RAY_ARGS, "--max-model-len", "99999999")
    assert s.proc.wait(300) == 2
    log = s.log_tail()
    assert "ember: error: max_model_len=99999999 is longer than the model's context (8192)" in log  # the replica's
    assert re.search(r"^ember: error: data-parallel replica [01] \(http://[\d.]+:\d+\) exited with code 2 before it "
                     r"was ready: its log above says why$", log, re.MULTILINE), log
    _wait_released([], 3.0)
