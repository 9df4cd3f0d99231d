"""The operations routes on the main server (server/operations.py; its --profiler-dir is
`traces`), each run by the engine core in its own process: /ping, /reset_prefix_cache, the
profiler, and sleep / wake-up at both levels, after which the server answers as before."""

from __future__ import annotations

import json
import re

import pytest
from servers import FRANCE, KEY, MODEL, assert_openai_error

httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

LONG = FRANCE + " and this prompt runs on long enough to fill a few blocks of the prefix cache, twice over."


def call(server, method: str, path: str, key: str = KEY, **kw) -> httpx.Response:
    return httpx.request(method, f"{server.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def complete(server, prompt: str = LONG) -> dict:
    r = call(server, "POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                       "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_ping_answers_without_the_key_as_health_does(server):
    assert [httpx.request(m, f"{server.url}/ping", timeout=10).status_code for m in ("GET", "POST")] == [200, 200]


def test_reset_prefix_cache_drops_the_cached_blocks(server):
    first = complete(server)
    assert cached(complete(server)) > 0
    assert call(server, "POST", "/reset_prefix_cache").status_code == 200
    again = complete(server)
    assert cached(again) == 0 and again["choices"] == first["choices"]
    assert call(server, "POST", "/reset_prefix_cache", key="wrong").status_code == 401  # behind the key


def test_the_profiler_writes_a_trace_of_the_steps_between_start_and_stop(server, traces):
    assert call(server, "POST", "/start_profile").status_code == 200
    assert_openai_error(call(server, "POST", "/start_profile"), 400, "already being recorded")
    complete(server, FRANCE)
    r = call(server, "POST", "/stop_profile")
    assert r.status_code == 200, r.text
    path = r.json()["trace"]
    assert path.startswith(str(traces)) and path.endswith(".pt.trace.json")
    names = [e.get("name") for e in json.loads(open(path).read())["traceEvents"]]
    assert names.count("ember_cpu::paged_attention") == 30 * 6  # 30 layers, 6 steps: one prefill, 5 decodes
    assert_openai_error(call(server, "POST", "/stop_profile"), 400, "no profile is being recorded")


def core_rss_mb(server) -> float:
    pid = re.search(r"the engine core runs in process (\d+)", server.log.read_text()).group(1)
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


# a KV block of SmolLM2 in float32 on the CPU: 30 layers x (k, v) x 3 KV heads x 64 dims x 16 tokens x 4 bytes
BLOCK_MB = 30 * 2 * 3 * 64 * 16 * 4 / 2**20


@pytest.mark.parametrize("level,weights_mb", [(1, 0), (2, 300)])  # level 2 frees the weights too, ~540 MB
def test_sleep_frees_the_engine_until_wake_up_and_then_it_answers_as_before(server, level, weights_mb):
    before = complete(server, FRANCE)
    # the pool's pages are the kernel's only once written: this prompt writes ~100 blocks; what the
    # server's other tests wrote before comes on top (how much depends on which ran here first)
    tokens = complete(server, f"Round {level}: " + "The quick brown fox jumps over the lazy dog. " * 150)["usage"][
        "prompt_tokens"]
    assert tokens > 1500
    awake = core_rss_mb(server)
    assert call(server, "POST", f"/sleep?level={level}").status_code == 200
    assert awake - core_rss_mb(server) > 0.9 * tokens // 16 * BLOCK_MB + weights_mb
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    error = assert_openai_error(call(server, "POST", "/v1/completions", json={"model": MODEL, "prompt": "x"}), 503,
                                "asleep", "/wake_up")
    assert error["code"] == "sleeping"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # alive, just asleep
    assert_openai_error(call(server, "POST", "/sleep?level=1"), 409, "asleep already")
    assert call(server, "POST", "/wake_up").status_code == 200
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    after = complete(server, FRANCE)
    assert after["choices"] == before["choices"] and cached(after) == 0  # the KV pool came back empty


@pytest.mark.parametrize("path,words", [
    ("/sleep?level=3", ["level must be 1"]), ("/sleep?tags=weights", ["takes only level"]),
    ("/wake_up?tags=weights", ["takes no parameters"]), ("/wake_up", ["the engine is awake"]),
])
def test_bad_operations_say_why(server, path, words):
    status = 409 if path == "/wake_up" else 400
    assert_openai_error(call(server, "POST", path), status, *words)
