"""ember's server behind SGLang's own router (`sglang-router` from PyPI, the Rust `smg`
inside), as users of SGLang run replicas: two `ember serve` workers, the router with its
cache-aware policy, and the real `openai` client. The router rewrites every request with
SGLang's fields (no_stop_trim, separate_reasoning, ...): ember takes them at the values that
are its behaviour, honours no_stop_trim, and refuses the rest by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from servers import MODEL, Server, free_port

from ember.server.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest

pytest.importorskip("sglang_router")

ASK = [{"role": "user", "content": "hi"}]


def test_sglangs_fields_at_embers_behaviour_are_taken_and_no_stop_trim_is_honoured():
    sent = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False, "skip_special_tokens": True}
    assert not ChatCompletionRequest(messages=ASK, **sent).to_sampling_params().include_stop_str_in_output
    kept = ChatCompletionRequest(messages=ASK, **(sent | {"no_stop_trim": True})).to_sampling_params()
    assert kept.include_stop_str_in_output
    assert CompletionRequest(prompt="x", no_stop_trim=True).to_sampling_params().include_stop_str_in_output
    for field, value in (("separate_reasoning", False), ("stream_reasoning", False), ("return_hidden_states", True)):
        with pytest.raises(InvalidRequest, match=f"^{field} .*not supported") as e:
            ChatCompletionRequest(messages=ASK, **{field: value}).to_sampling_params()
        assert e.value.param == field


@pytest.fixture(scope="module")
def sglang_router(gguf_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sglang-router")
    workers = [Server(gguf_path, logs / f"worker{i}.log") for i in range(2)]
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[w.url for w in workers],
           "--port", str(port), "--policy", "cache_aware", "--prometheus-port", str(free_port()),
           "--log-level", "warn"]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = subprocess.Popen(cmd, stdout=(logs / "router.log").open("w"), stderr=subprocess.STDOUT,
                                  env=os.environ | {"HF_HUB_OFFLINE": "1"})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, (logs / "router.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (logs / "router.log").read_text()[-3000:]
            time.sleep(0.2)
        yield url, workers
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(30)
            except subprocess.TimeoutExpired:
                router.kill()
        for w in workers:
            w.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.slow
def test_answers_through_sglangs_router_equal_a_workers_own(sglang_router):
    url, workers = sglang_router
    via, direct = _client(url), _client(workers[0].url)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
                temperature=0)
    want = direct.chat.completions.create(**chat).choices[0].message.content
    assert via.chat.completions.create(**chat).choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in via.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == want
    prompt = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert via.completions.create(**prompt).choices[0].text == direct.completions.create(**prompt).choices[0].text
    # a stop string: the router sends no_stop_trim false, so it is trimmed as OpenAI does
    stopped = via.completions.create(**prompt | {"stop": [" Paris"]}).choices[0]
    assert stopped.text == "" and stopped.finish_reason == "stop"


@pytest.mark.slow
def test_a_conversation_through_sglangs_router_finds_its_prefix_cached(sglang_router):
    url, workers = sglang_router
    client = _client(url)
    system = {"role": "system", "content": "You are the archivist of a mountain library. " * 12}
    first = [system, {"role": "user", "content": "When are you open?"}]
    hits = sum(w.metrics()["prefix_cache_hits_total"] for w in workers)
    answer = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    again = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "And on Sundays?"}]
    client.chat.completions.create(model=MODEL, messages=again, max_tokens=8, temperature=0)
    # the follow-up went where the first turn ran: its ~100-token system prompt came from the cache
    assert sum(w.metrics()["prefix_cache_hits_total"] for w in workers) - hits >= 96
