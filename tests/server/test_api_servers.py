"""`ember serve --api-server-count 2`: two API processes on one port in front of one engine
core process. They answer as one process does (the session `server`, on the same model and
flags), share the work, render one set of /metrics totals, act once on the core for the
operations routes; a killed API process loses only its own requests (the core frees their
blocks) and a killed core ends them all; SIGTERM leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from processes import alive, descendants, gone
from servers import FRANCE, KEY, MODEL, Server

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,", "The quick brown fox", "Water boils at",
           "My favourite colour is", "In 1492, Columbus", "Roses are red,"]
HEADER = "x-ember-api-server"


def two_servers(gguf_path, tmp_path_factory) -> Server:
    s = Server(gguf_path, tmp_path_factory.mktemp("api2") / "server.log", "--api-key", KEY, "--api-server-count", "2")
    s.wait_ready()
    return s


def served_by(headers) -> int | None:
    """Which API process answered (its index; None from a server of one)."""
    return int(headers[HEADER].split()[0]) if HEADER in headers else None


def get(server: Server, path: str) -> httpx.Response:
    """A GET on a connection of its own (so either process may take it)."""
    return httpx.get(f"{server.url}{path}", timeout=30, headers={"Authorization": f"Bearer {KEY}"})


def from_each(server: Server, path: str) -> dict[int, httpx.Response]:
    """GET `path` until each of the two API processes has answered it."""
    answers: dict[int, httpx.Response] = {}
    for _ in range(200):
        r = get(server, path)
        answers.setdefault(served_by(r.headers), r)
        if len(answers) == 2:
            return answers
    pytest.fail(f"only API server(s) {sorted(answers)} answered {path}")


def counters(text: str) -> dict[str, float]:
    """{'name,label="value"': value} of a /metrics text's ember: samples, model_name and histogram
    buckets left out."""
    out = {}
    for m in re.finditer(r"^ember:(\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        if not m.group(1).endswith(("_bucket", "_created")):
            labels = sorted(x for x in m.group(2).split(",") if x and not x.startswith("model_name="))
            out[",".join([m.group(1), *labels])] = float(m.group(3))
    return out


@pytest.fixture(scope="module")
def two(gguf_path, tmp_path_factory):
    """The two-process server; SIGTERM at the end lets a request in flight finish, then stops
    every one of its processes, exit 0."""
    s = two_servers(gguf_path, tmp_path_factory)
    started = descendants(s.proc.pid)
    answer: list = []
    busy = threading.Thread(target=lambda: answer.append(s.client().completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})))
    try:
        s.wait_api_servers(2)
        yield s
        busy.start()
        time.sleep(0.3)  # it runs
    finally:
        code = s.stop()
    busy.join(30)
    assert answer and answer[0].usage.completion_tokens == 30  # drained, not cut off
    assert code == 0, s.log_tail()
    assert "Traceback" not in s.log.read_text(), s.log.read_text()
    # the core, the 2 API processes (and multiprocessing's resource tracker)
    assert len(started) >= 3 and gone(started, 10), [p for p in started if alive(p)]


def _ask(server: Server, i: int) -> tuple[int | None, list[str], int, int]:
    """Request i of a mix (completions and chat, streamed or not, n=2 for some; greedy) on a
    connection of its own: (which process answered, each choice's text, prompt tokens,
    completion tokens)."""
    client = server.client()
    body = {"model": MODEL, "max_tokens": 6 + i % 4, "temperature": 0, "n": 2 if i % 8 in (4, 5) else 1}
    stream = i % 2 == 1
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    completion = i % 4 < 2
    if completion:
        raw = client.completions.with_raw_response.create(prompt=PROMPTS[i % len(PROMPTS)], **body)
    else:
        raw = client.chat.completions.with_raw_response.create(
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], **body)
    out = raw.parse()
    if not stream:
        texts = [c.text if completion else c.message.content for c in out.choices]
        return served_by(raw.headers), texts, out.usage.prompt_tokens, out.usage.completion_tokens
    texts, usage = [""] * body["n"], None
    for chunk in out:
        for c in chunk.choices:
            texts[c.index] += (c.text if completion else c.delta.content) or ""
        usage = chunk.usage or usage
    return served_by(raw.headers), texts, usage.prompt_tokens, usage.completion_tokens


def test_two_api_processes_answer_as_one_and_count_every_request_once(two, server):
    before = counters(get(two, "/metrics").text)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _ask(two, i), range(16)))
        want = list(pool.map(lambda i: _ask(server, i), range(16)))
    assert [g[1:] for g in got] == [w[1:] for w in want]  # text and usage, request by request
    assert {g[0] for g in got} == {0, 1}, [g[0] for g in got]  # both processes served
    assert {w[0] for w in want} == {None}
    assert sum(len(text) > 0 for g in got for text in g[1]) > 12
    assert [len(g[1]) for g in got] == [2 if i % 8 in (4, 5) else 1 for i in range(16)]

    totals = {i: counters(r.text) for i, r in from_each(two, "/metrics").items()}
    assert totals[0] == totals[1]  # one set of numbers, whichever process answers
    after = totals[0]
    finished = sum(after[k] - before.get(k, 0) for k in after if k.startswith("request_success_total"))
    assert finished == 16
    assert after['request_success_total,finished_reason="length"'] - before[
        'request_success_total,finished_reason="length"'] == sum(g[3] == len(g[1]) * (6 + i % 4)
                                                                  for i, g in enumerate(got))
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == sum(g[2] for g in got)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == sum(g[3] for g in got)
    assert after["e2e_request_latency_seconds_count"] - before["e2e_request_latency_seconds_count"] == 16
    # the core's counters come from the core: every prompt token looked up once, not once a process
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == sum(g[2] for g in got)
    assert after["num_requests_running"] == after["kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("flags,says", [
    (["--api-server-count", "0"], "--api-server-count must be >= 1"),
    (["-asc", "2", "--data-parallel-size", "2"], "give one of the two flags"),
    (["--api-server-count", "2", "--no-core-process"], "drop --no-core-process"),
    (["--api-server-count", "2", "--distributed-executor-backend", "ray"], "use the mp backend, or one API server"),
])
def test_what_several_api_processes_cannot_run_with_is_refused_at_launch(flags, says):
    from ember.server.cli import cmd_serve, parse_args

    with pytest.raises(ValueError, match=re.escape(says)):
        cmd_serve(parse_args(["serve", *flags]))


def test_sleep_asked_of_one_process_holds_for_both(two):
    r = httpx.post(f"{two.url}/sleep?level=1", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    for answer in from_each(two, "/is_sleeping").values():
        assert answer.json() == {"is_sleeping": True}
    for _ in range(6):  # refused by whichever process takes it
        with pytest.raises(openai.APIStatusError) as refused:
            two.client().completions.create(model=MODEL, prompt=FRANCE, max_tokens=2)
        assert refused.value.status_code == 503 and "asleep" in refused.value.message
    r = httpx.post(f"{two.url}/wake_up", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    for answer in from_each(two, "/is_sleeping").values():
        assert answer.json() == {"is_sleeping": False}
    assert two.client().completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0).choices[0].text \
        == " Paris."


class _Stream(threading.Thread):
    """A long streamed completion on a connection of its own: which process took it, the lines
    it got; `leave` closes it early (the client goes away)."""

    def __init__(self, server: Server, **fields) -> None:
        super().__init__(daemon=True)
        self.server, self.fields, self.lines, self.index = server, fields, [], None
        self.started, self.leave = threading.Event(), threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": FRANCE, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
                "stream": True, **self.fields}
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                self.index = served_by(r.headers)
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
                    if self.leave.is_set():
                        return
        except httpx.HTTPError as e:  # its process was killed
            self.lines.append(f"broken: {type(e).__name__}")
        finally:
            self.started.set()


def test_one_request_id_in_each_api_process_is_two_requests(two, server):
    """A client's request_id is its own process's: the core tells the two processes' apart, while
    within one process a second request under an id in use is refused, as with one process."""
    running = _Stream(two, request_id="twice")
    assert running.started.wait(60) and running.index is not None, running.lines
    want = server.client().completions.create(model=MODEL, prompt="Water boils at", max_tokens=8, temperature=0)
    answers: dict[int, httpx.Response] = {}
    for _ in range(200):
        r = httpx.post(f"{two.url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "Water boils at", "max_tokens": 8, "temperature": 0,
                             "request_id": "twice"})
        answers.setdefault(served_by(r.headers), r)
        if len(answers) == 2:
            break
    running.leave.set()
    running.join(30)
    same, other = answers[running.index], answers[1 - running.index]
    assert same.status_code == 400 and "already in use" in same.json()["error"]["message"]
    assert other.status_code == 200, other.text
    assert other.json()["id"] == "cmpl-twice" and other.json()["choices"][0]["text"] == want.choices[0].text
    assert not running.lines[-1].startswith(("broken", "data: {\"error"))  # it ran until it was left
    two.wait_idle()


def test_a_killed_api_process_loses_only_its_requests_and_a_killed_core_ends_the_server(gguf_path,
                                                                                        tmp_path_factory):
    s = two_servers(gguf_path, tmp_path_factory)
    try:
        s.wait_api_servers(2)
        processes = descendants(s.proc.pid)
        streams: list[_Stream] = []
        while len({t.index for t in streams}) < 2 and len(streams) < 12:
            streams.append(_Stream(s))
            assert streams[-1].started.wait(60), s.log_tail()
        on = {i: [t for t in streams if t.index == i] for i in (0, 1)}
        assert on[0] and on[1], [t.index for t in streams]
        killed = int(s.log.read_text().split("API servers (processes ")[1].split(")")[0].split(", ")[1])
        os.kill(killed, signal.SIGKILL)
        for t in on[1]:
            t.join(30)
            assert t.lines[-1].startswith("broken"), t.lines[-3:]
        # the core aborted the killed process's requests: only the survivor's run
        deadline = time.monotonic() + 30
        while (running := counters(get(s, "/metrics").text)["num_requests_running"]) != len(on[0]):
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
        seen = [len(t.lines) for t in on[0]]
        time.sleep(0.5)
        assert all(len(t.lines) > n for t, n in zip(on[0], seen))  # they go on
        for t in on[0]:
            t.leave.set()
            t.join(30)
        idle = s.wait_idle(30)  # no block is held for anyone's request
        assert idle["num_requests_running"] == idle["num_requests_waiting"] == idle["kv_cache_usage_perc"] == 0
        raw = s.client().completions.with_raw_response.create(model=MODEL, prompt=FRANCE, max_tokens=2,
                                                               temperature=0)
        assert served_by(raw.headers) == 0 and raw.parse().choices[0].text == " Paris."
        assert f"API server 1 (process {killed}) exited: its requests are aborted" in s.log.read_text()

        # then the core dies: the survivor's open stream gets an error event, and everything exits 1
        last = _Stream(s)
        assert last.started.wait(60) and last.index == 0
        core = int(re.search(r"in front of the engine core \(process (\d+)\)", s.log.read_text()).group(1))
        os.kill(core, signal.SIGKILL)
        last.join(30)
        assert last.lines[-1] == "data: [DONE]", last.lines[-3:]
        error = json.loads(last.lines[-2].removeprefix("data: "))["error"]
        assert error["message"] == "the engine loop died: the server is going down (see its log)"
        assert s.proc.wait(30) == 1, s.log_tail()
        assert gone(processes, 10), [p for p in processes if alive(p)]
        assert "the engine core process exited (exit code -9): every API server stops" in s.log.read_text()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
