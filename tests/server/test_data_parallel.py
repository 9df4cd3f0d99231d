"""`ember serve --data-parallel-size 2`: two replica processes behind the cache-aware router
on the address asked for. Through the real `openai` client the answers equal the offline
engine's; a conversation's turns stay on one replica; SIGTERM stops everything cleanly, and
a SIGKILLed parent leaves no replica behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import torch
from processes import alive, children
from servers import KEY, MODEL, Server

from ember import LLM, SamplingParams
from ember.server.data_parallel import replica_argv, replica_env, run_data_parallel

pytestmark = pytest.mark.slow


def test_a_replica_gets_the_flags_but_the_parents_own():
    argv = ["serve", "m.gguf", "--port", "9000", "--data-parallel-size=2", "--host", "0.0.0.0", "--api-key", "k",
            "--max-num-seqs", "4"]
    assert replica_argv(argv, 41234) == ["serve", "m.gguf", "--api-key", "k", "--max-num-seqs", "4", "--host",
                                         "127.0.0.1", "--port", "41234", "--data-parallel-size", "1"]
    assert replica_argv(["serve", "m", "--port=1", "--data-parallel-size", "3"], 5) == \
        ["serve", "m", "--host", "127.0.0.1", "--port", "5", "--data-parallel-size", "1"]
    assert replica_argv(["serve", "m", "--data-parallel-backend", "ray", "--data-parallel-size=2"], 7, "10.0.0.2") == \
        ["serve", "m", "--host", "10.0.0.2", "--port", "7", "--data-parallel-size", "1"]


def test_a_replica_gets_its_gpu_or_its_share_of_the_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert replica_env(1, 2, "cpu")["OMP_NUM_THREADS"] == "4"
    assert replica_env(0, 16, "cpu")["OMP_NUM_THREADS"] == "1"
    assert replica_env(1, 2, "cuda")["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert replica_env(1, 2, "cuda")["CUDA_VISIBLE_DEVICES"] == "6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # with tensor parallelism each replica gets its own run of GPUs for its ranks
    assert [replica_env(i, 2, "cuda", 2)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3,4,5,6,7")
    assert [replica_env(i, 3, "cuda", 2)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["1,3", "4,5", "6,7"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert replica_env(0, 2, "cpu")["OMP_NUM_THREADS"] == "3"
    # the replicas share the host's memory: the default host tier's share of each (defaults.py)
    assert replica_env(1, 3, "cuda")["EMBER_ENGINES_ON_HOST"] == "3"


def test_too_few_gpus_for_the_replicas_and_their_ranks_is_refused_before_any_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ValueError) as e:
        run_data_parallel(["serve", "m"], 2, "cuda", "127.0.0.1", 0, "warning", tensor_parallel_size=2)
    assert str(e.value) == ("--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, and 3 are visible: "
                            "lower them, or run on the CPU (--device cpu)")
    with pytest.raises(ValueError, match=r"^--data-parallel-size 4 needs 4 GPUs, and 3 are visible: lower it,"):
        run_data_parallel(["serve", "m"], 4, "cuda", "127.0.0.1", 0, "warning")


@pytest.fixture(scope="module")
def reference(gguf_path):
    return LLM(str(gguf_path), quantization="none", dtype="float32", num_kv_blocks=128)


def _chat(client, text: str) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12,
                                       temperature=0)
    return r.choices[0].message.content


def test_two_replicas_answer_as_one_engine_and_stop_cleanly(gguf_path, tmp_path, reference):
    s = Server(gguf_path, tmp_path / "dp.log", "--api-key", KEY, "--data-parallel-size", "2", "--num-kv-blocks", "128")
    try:
        s.wait_ready()
        replicas = children(s.proc.pid)
        assert len(replicas) == 2, s.log_tail()
        client = s.client()
        questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
        want = [reference.chat([{"role": "user", "content": q}], SamplingParams(max_tokens=12, temperature=0))
                [0].outputs[0].text for q in questions]
        assert [_chat(client, q) for q in questions] == want
        stats = httpx.get(f"{s.url}/router/stats", timeout=10).json()["workers"]
        assert [w["healthy"] for w in stats] == [True, True] and sum(w["routed"] for w in stats) == 3
        assert min(w["routed"] for w in stats) >= 1  # new text spreads over both replicas
        # the other routes go through the router too
        tokens = httpx.post(f"{s.url}/tokenize", json={"model": MODEL, "prompt": questions[0]}, timeout=30,
                            headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
        assert tokens == reference.get_tokenizer().encode(questions[0])
        anthropic = pytest.importorskip("anthropic")
        message = anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0).messages.create(
            model=MODEL, max_tokens=12, messages=[{"role": "user", "content": questions[0]}],
            extra_body={"temperature": 0})
        assert message.content[0].text == want[0]
        assert client.responses.create(model=MODEL, input=questions[1], max_output_tokens=12,
                                       temperature=0).output_text == want[1]
        # the operations routes reach every replica: both sleep, both wake, both answer again
        auth = {"Authorization": f"Bearer {KEY}"}

        def op(method: str, path: str, **kw) -> httpx.Response:
            return httpx.request(method, f"{s.url}{path}", headers=auth, timeout=60, **kw)

        assert op("POST", "/reset_prefix_cache").status_code == 200
        assert op("GET", "/ping").status_code == 200
        assert op("POST", "/sleep", params={"level": "1"}).status_code == 200
        assert op("GET", "/is_sleeping").json() == {"is_sleeping": True}
        for w in stats:
            assert httpx.get(f"{w['url']}/is_sleeping", headers=auth, timeout=10).json() == {"is_sleeping": True}
        refused = op("POST", "/sleep", params={"level": "3"})
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(stats[0]["url"] + ": ")
        assert op("POST", "/wake_up").status_code == 200
        assert op("GET", "/is_sleeping").json() == {"is_sleeping": False}
        assert [_chat(client, q) for q in questions[:2]] == want[:2]
        profile = op("POST", "/start_profile")
        assert profile.status_code == 400 and "--profiler-dir" in profile.json()["error"]["message"]
    finally:
        code = s.stop()
    assert code == 0, s.log_tail()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in replicas) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in replicas)


def test_a_killed_parent_leaves_no_replica_behind(gguf_path, tmp_path):
    s = Server(gguf_path, tmp_path / "dp.log", "--data-parallel-size", "2", "--num-kv-blocks", "64")
    try:
        s.wait_ready()
        replicas = children(s.proc.pid)
        assert len(replicas) == 2, s.log_tail()
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(30)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in replicas) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in replicas), [p for p in replicas if alive(p)]
    finally:
        s.stop()


def test_a_replica_that_cannot_start_ends_the_command_with_its_error(gguf_path, tmp_path):
    s = Server(gguf_path, tmp_path / "dp.log", "--data-parallel-size", "2", "--max-model-len", "99999999")
    assert s.proc.wait(300) == 2
    assert "data-parallel replica 0" in s.log_tail() or "data-parallel replica 1" in s.log_tail()
