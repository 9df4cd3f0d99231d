"""`ember serve` with the engine core in its own process (the default): the same answers
as the core on a thread of the server (`--no-core-process`), and the process boundary's
failures: a killed core process, a killed API process, a storm of disconnects, SIGTERM.

The servers run the default model as shipped (its GGUF blocks, `--quantization auto`), whose
path is batch-invariant by construction: a request's tokens do not depend on what shares its
steps, so the two processes' different timing cannot change an answer, and any difference
is the boundary's."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import threading
import time

import pytest
from processes import alive, children, gone, parent_pid
from servers import MODEL, Server, running

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def core_pid(server: Server) -> int:
    """The engine core's process, as the server's log names it."""
    found = re.search(r"the engine core runs in process (\d+)", server.log.read_text())
    assert found, server.log_tail()
    return int(found.group(1))


def make_server(gguf_path, tmp_path_factory, *args: str) -> Server:
    return Server(gguf_path, tmp_path_factory.mktemp("core") / "server.log", "--dtype", "auto", "--quantization", "auto",
                  *args)


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    yield from running(make_server(gguf_path, tmp_path_factory))


@pytest.fixture(scope="module")
def one_process(gguf_path, tmp_path_factory):
    yield from running(make_server(gguf_path, tmp_path_factory, "--no-core-process"))


# ---- the same answers -----------------------------------------------------------------------


def _requests() -> list[tuple[str, dict]]:
    """64 requests: greedy and seeded completions, streamed or not, n, logprobs, echo, prompt
    logprobs, stop strings, a JSON schema, a choice, a forced tool call and tools left to the model."""
    prompts = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "The quick brown fox", "Water boils at",
               "My favourite colour is", "In 1492, Columbus", "Roses are red,"]
    reqs: list[tuple[str, dict]] = []
    for i in range(64):
        prompt = prompts[i % len(prompts)]
        kind = i % 8
        base = {"model": MODEL, "max_tokens": 12 + i % 5, "stream": i % 2 == 0}
        if kind == 0:
            reqs.append(("completions", base | {"prompt": prompt, "temperature": 0}))
        elif kind == 1:
            reqs.append(("completions", base | {"prompt": prompt, "temperature": 0.8, "seed": i, "n": 2}))
        elif kind == 2:
            reqs.append(("completions", base | {"prompt": prompt, "temperature": 0, "logprobs": 2, "echo": not base["stream"]}))
        elif kind == 3:
            reqs.append(("completions", base | {"prompt": prompt, "temperature": 0, "stop": ["\n", " the"],
                                                "prompt_logprobs": None if base["stream"] else 1}))
        elif kind == 4:
            reqs.append(("chat/completions", base | {"messages": [{"role": "user", "content": f"Tell me about {prompt}"}],
                                                     "temperature": 0, "logprobs": True, "top_logprobs": 2}))
        elif kind == 5:
            reqs.append(("chat/completions", base | {"messages": [{"role": "user", "content": "Make up a person"}],
                                                     "temperature": 0.7, "seed": i, "max_tokens": 40,
                                                     "response_format": {"type": "json_schema", "json_schema": {
                                                         "name": "person", "schema": PERSON}}}))
        elif kind == 6:
            reqs.append(("chat/completions", base | {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                                     "temperature": 0, "max_tokens": 40, "tools": [WEATHER],
                                                     "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_weather"}}}))
        else:
            reqs.append(("completions", base | {"prompt": prompt, "temperature": 0,
                                                "structured_outputs": {"choice": ["yes", "no", "maybe"]}}))
    return reqs


def _comparable(body):
    """A response without what differs between any two answers: ids, times, and how many prompt
    tokens the prefix cache held (that depends on which of the concurrent requests got there first)."""
    if isinstance(body, dict):
        return {k: _comparable(v) for k, v in body.items() if k not in ("id", "created", "cached_tokens")}
    if isinstance(body, list):
        return [_comparable(v) for v in body]
    return body


def _merge(into: dict, piece: dict) -> None:
    """Fold one streamed piece into what came before: text joins, lists extend, tool calls by index."""
    for k, v in piece.items():
        if k == "tool_calls":
            calls = into.setdefault(k, {})
            for call in v or []:
                _merge(calls.setdefault(call["index"], {}), call)
        elif isinstance(v, str) and isinstance(into.get(k), str) and k not in ("index", "type", "object", "model"):
            into[k] += v
        elif isinstance(v, list) and isinstance(into.get(k), list):
            into[k] = into[k] + v
        elif isinstance(v, dict):
            if not isinstance(into.get(k), dict):
                into[k] = {}
            _merge(into[k], v)
        elif v is not None or k not in into:
            into[k] = v


def _folded(events: list[dict]) -> dict:
    """A stream as the sum of its chunks: the API process collapses the deltas it has not sent
    yet into one chunk (async_engine.py), so where a stream's chunks break depends on timing,
    never what they add up to."""
    out: dict = {"choices": {}}
    for event in events:
        _merge(out, {k: v for k, v in event.items() if k != "choices"})
        for c in event.get("choices", []):
            _merge(out["choices"].setdefault(c["index"], {}), c)
    return out


async def _answer(client: httpx.AsyncClient, url: str, path: str, body: dict):
    if not body["stream"]:
        r = await client.post(f"{url}/v1/{path}", json=body)
        assert r.status_code == 200, r.text
        body_ = r.json()
        if path == "chat/completions":  # a tool call's id is random
            for c in body_["choices"]:
                for call in c["message"].get("tool_calls") or []:
                    call.pop("id")
        return _comparable(body_)
    events = []
    async with client.stream("POST", f"{url}/v1/{path}", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                for c in chunk.get("choices", []):
                    for call in (c.get("delta") or {}).get("tool_calls") or []:
                        call.pop("id", None)
                events.append(_comparable(chunk))
    assert events
    return _folded(events)


async def _all(url: str, reqs: list[tuple[str, dict]]):
    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*[_answer(client, url, path, body) for path, body in reqs])


def test_the_core_runs_in_a_child_process(server):
    pid = core_pid(server)
    assert pid != server.proc.pid and parent_pid(pid) == server.proc.pid and alive(pid)


def test_64_concurrent_mixed_requests_get_the_answers_of_the_in_process_core(server, one_process):
    reqs = _requests()
    got = asyncio.run(_all(server.url, reqs))
    want = asyncio.run(_all(one_process.url, reqs))
    for (path, body), g, w in zip(reqs, got, want):
        assert g == w, (path, body)
    finals = [g for (_, body), g in zip(reqs, got) if not body["stream"]]
    assert sum(len(c.get("text") or c.get("message", {}).get("content") or "") > 0
               for f in finals for c in f["choices"]) > 20  # they said something
    assert core_pid(one_process) == one_process.proc.pid
    server.wait_idle()


SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


def test_speculative_decoding_serves_the_same_answers_and_counts_its_drafts(server, gguf_path, tmp_path_factory):
    """`--speculative-config` (vLLM's JSON): every request of the mix that does not sample at a
    temperature (those draw other random numbers) gets the plain server's answer, streamed or
    not, with logprobs, stop strings inside accepted runs, a guided choice and tools; the drafts
    are counted under vLLM's metric names."""
    reqs = [(path, body) for path, body in _requests() if body["temperature"] == 0]
    spec_server = make_server(gguf_path, tmp_path_factory, "--speculative-config", SPEC)
    for spec in running(spec_server):
        got = asyncio.run(_all(spec.url, reqs))
        want = asyncio.run(_all(server.url, reqs))
        for (path, body), g, w in zip(reqs, got, want):
            for answer in (g, w):  # prefix-cache hits follow the timing, which speculation changes
                (answer.get("usage") or {}).pop("prompt_tokens_details", None)
            assert g == w, (path, body)
        m = spec.wait_idle()
        assert m["spec_decode_num_drafts_total"] > 0
        assert 0 < m["spec_decode_num_accepted_tokens_total"] < m["spec_decode_num_draft_tokens_total"]
        per_position = [m.get(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0) for i in range(4)]
        assert per_position[0] > 0 and per_position == sorted(per_position, reverse=True)
        assert sum(per_position) == m["spec_decode_num_accepted_tokens_total"]
    server.wait_idle()


def test_500_disconnects_leave_no_block_held(server):
    async def leave_early(client: httpx.AsyncClient, i: int, gate: asyncio.Semaphore) -> None:
        body = {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with gate:
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                seen, stop_after = 0, random.Random(i).randrange(0, 4)
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen > stop_after:
                            break  # the connection closes with the block: the server sees a disconnect

    async def storm() -> None:
        gate = asyncio.Semaphore(64)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(*[leave_early(client, i, gate) for i in range(500)])

    asyncio.run(storm())
    m = server.wait_idle(60)
    assert m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0
    out = server.client().completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."


# ---- failures at the boundary ---------------------------------------------------------------


def test_a_killed_core_process_fails_the_streams_and_the_server_exits_1(gguf_path, tmp_path_factory):
    s = make_server(gguf_path, tmp_path_factory)
    s.wait_ready()
    pid = core_pid(s)
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": FRANCE, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert started.wait(60), s.log_tail()
    os.kill(pid, signal.SIGKILL)
    assert s.proc.wait(30) == 1, s.log_tail()
    streamer.join(10)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["message"] == "the engine loop died: the server is going down (see its log)" and error["code"] == 503
    assert "the engine core process exited (exit code -9)" in s.log.read_text()


def test_a_killed_api_process_takes_its_core_process_with_it(gguf_path, tmp_path_factory):
    s = make_server(gguf_path, tmp_path_factory)
    s.wait_ready()
    pid = core_pid(s)
    s.proc.kill()
    s.proc.wait()
    assert gone([pid], 15), f"process {pid} is still alive"
    assert "the API server process is gone: the engine core stops" in s.log.read_text()


def test_sigterm_stops_both_processes_and_leaves_none_behind(gguf_path, tmp_path_factory):
    """SIGTERM to every process of the server, as systemd sends it to a service's cgroup (and a
    terminal's Ctrl-C to its process group): the core keeps serving while the API drains."""
    s = make_server(gguf_path, tmp_path_factory, "--shutdown-timeout", "20")
    s.wait_ready()
    pid = core_pid(s)
    started = children(s.proc.pid)
    assert pid in started
    out = s.client().completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."
    answer: list = []
    busy = threading.Thread(target=lambda: answer.append(s.client().completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})))
    busy.start()
    time.sleep(0.5)  # it runs
    for child in started:
        os.kill(child, signal.SIGTERM)
    s.proc.send_signal(signal.SIGTERM)
    busy.join(60)
    assert answer and answer[0].usage.completion_tokens == 60  # drained, not cut off
    assert s.proc.wait(60) == 0, s.log_tail()
    assert gone(started, 5), [p for p in started if alive(p)]
    log = s.log.read_text()
    assert "Traceback" not in log and "killing it" not in log, log


def test_a_server_that_cannot_listen_stops_the_core_it_started(gguf_path, tmp_path_factory):
    """The core starts before the web stack is imported (it loads the model meanwhile): a port in
    use ends the command with uvicorn's error, and the core goes with it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = make_server(gguf_path, tmp_path_factory, "--port", str(taken.getsockname()[1]))
        assert s.proc.wait(120) == 3, s.log_tail()  # uvicorn's exit code for a failed start
    log = s.log.read_text()
    assert "address already in use" in log, log
    found = re.search(r"the engine core starts in process (\d+)", log)
    assert found, log
    assert gone([int(found.group(1))], 10)
