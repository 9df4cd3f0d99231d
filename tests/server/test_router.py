"""`ember router`: the cache-aware policy (pure, exact expectations), then end to end: two
real `ember serve` workers on the default model behind a real router process, driven by the
official `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from servers import KEY, MODEL, Server, assert_openai_error, free_port

from ember.router.policy import CacheAwarePolicy, NoHealthyWorker, PolicyConfig, PrefixTree

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

A, B, C = "http://a", "http://b", "http://c"
SYSTEM = "You are a helpful assistant who answers in one short sentence. "  # 64 characters


# ---- the prefix tree ---------------------------------------------------------------------


def test_prefix_tree_matches_the_longest_prefix_it_holds():
    t = PrefixTree(max_chars=1000)
    assert t.match("hello") == 0
    t.insert("hello world")
    t.insert("hello there")  # splits the edge after "hello "
    t.insert("help")
    assert t.size == len("hel") + len("lo ") + len("world") + len("there") + len("p")
    assert [t.match(s) for s in ["hello world", "hello world!", "hello wx", "hello", "helium", "x", ""]] == \
        [11, 11, 7, 5, 3, 0, 0]
    t.insert("hello")  # inside an edge: a split, no new characters
    assert t.size == 17 and t.match("hello") == 5


def test_prefix_tree_evicts_the_least_recently_used_leaves_first():
    t = PrefixTree(max_chars=12)
    t.insert("aaaa1111")  # 8
    t.insert("bbbb")  # 12: full
    t.insert("aaaa2222")  # "aaaa" is used again; 16 > 12: the oldest leaf, "1111", goes
    assert (t.size, t.match("aaaa1111"), t.match("bbbb"), t.match("aaaa2222")) == (12, 4, 4, 8)
    t.insert("bbbb")  # used again: now "2222" is the oldest leaf
    t.insert("cc")  # 14 > 12: "2222" goes; "aaaa" becomes a leaf, but 10 fits
    assert (t.size, t.match("aaaa2222"), t.match("aaaa"), t.match("bbbb"), t.match("cc")) == (10, 4, 4, 4, 2)
    t.insert("dddddddd")  # 18: "aaaa" (the oldest), then "bbbb"
    assert (t.size, t.match("aaaa"), t.match("bbbb"), t.match("cc"), t.match("dddddddd")) == (10, 0, 0, 2, 8)
    t.clear()
    assert (t.size, t.match("cc")) == (0, 0)


def test_prefix_tree_refuses_a_size_of_zero():
    with pytest.raises(ValueError, match="max_chars must be positive"):
        PrefixTree(0)


# ---- the policy --------------------------------------------------------------------------


def _urls(policy: CacheAwarePolicy, texts: list[str], finish: bool = True) -> list[str]:
    out = []
    for text in texts:
        w = policy.route(text)
        out.append(w.url)
        if finish:
            policy.finished(w)
    return out


def test_new_prefixes_spread_and_a_shared_prefix_follows_its_worker():
    policy = CacheAwarePolicy([A, B, C])
    convs = [SYSTEM + f"conversation {i}: hello" for i in range(3)]
    # idle workers with empty trees: the first listed; then the one with the smallest tree
    assert _urls(policy, [convs[0], "other text entirely", convs[1]]) == [A, B, A]
    # convs[1] matches A for 64 + 13 of 86 chars (>= 0.5): A; a follow-up turn of each conversation goes where it began
    assert _urls(policy, [convs[1] + " and more", convs[0] + " again", "other text entirely, a second turn"]) == [A, A, B]
    assert [(w.routed, w.cache_routed) for w in policy.workers] == [(4, 3), (2, 1), (0, 0)]


def test_the_cache_threshold_decides_between_the_match_and_the_least_loaded():
    text = "x" * 50 + "y" * 50
    for threshold, expected in [(0.5, A), (0.51, B)]:  # A holds exactly half of the text
        policy = CacheAwarePolicy([A, B], PolicyConfig(cache_threshold=threshold))
        policy.worker(A).tree.insert("x" * 50)
        assert _urls(policy, [text]) == [expected]
    # below the threshold, the least loaded wins even over a longer match
    policy = CacheAwarePolicy([A, B], PolicyConfig(cache_threshold=0.9))
    policy.worker(A).tree.insert("x" * 80)
    policy.worker(B).tree.insert("x" * 10)
    busy = policy.route("z")  # B: A's tree is larger
    assert busy.url == B
    assert _urls(policy, [text]) == [A]  # A: no request in flight


def test_equal_matches_go_to_the_least_loaded_then_the_first_listed():
    policy = CacheAwarePolicy([A, B, C])
    for w in policy.workers:
        w.tree.insert(SYSTEM)
    assert _urls(policy, [SYSTEM + "q"], finish=False) == [A]  # all equal: the first; A now has 1 in flight
    assert _urls(policy, [SYSTEM + "r"], finish=False) == [B]
    assert _urls(policy, [SYSTEM + "s"], finish=False) == [C]
    assert _urls(policy, [SYSTEM + "q!"], finish=False) == [A]  # the longest match beats a lower load


def test_imbalanced_loads_fall_back_to_the_shortest_queue():
    policy = CacheAwarePolicy([A, B], PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=2.0))
    # one long conversation keeps going to A while B is idle: A's queue grows
    assert _urls(policy, [SYSTEM + f"turn {i}" for i in range(5)], finish=False) == [A] * 5
    # A: 5 in flight, B: 0; 5 - 0 > 4 and 5 > 2 x 0: imbalanced, the next goes to B despite the match
    assert _urls(policy, [SYSTEM + "turn 5"], finish=False) == [B]
    # 5 vs 1: 4 is not > 4: balanced again; A holds the longest prefix (all of "turn 4"), B only "turn "
    assert _urls(policy, [SYSTEM + "turn 4, more"], finish=False) == [A]
    # 6 vs 1: 5 > 4 and 6 > 2 x 1: imbalanced
    assert _urls(policy, [SYSTEM + "turn 4, more again"], finish=False) == [B]
    assert (policy.worker(A).in_flight, policy.worker(B).in_flight) == (6, 2)
    # equal matches ("turn " on both): the less loaded
    assert _urls(policy, [SYSTEM + "turn 9"], finish=False) == [B]


def test_the_relative_threshold_alone_keeps_loads_balanced():
    policy = CacheAwarePolicy([A, B], PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=3.0))
    for w in (A, B):
        policy.worker(w).in_flight = {A: 9, B: 3}[w]
    policy.worker(A).tree.insert(SYSTEM)
    assert _urls(policy, [SYSTEM]) == [A]  # 9 - 3 > 2 but 9 is not > 3 x 3: the match decides
    policy.worker(B).in_flight = 2
    assert _urls(policy, [SYSTEM]) == [B]  # 9 - 2 > 2 and 9 > 6: shortest queue


def test_a_worker_out_of_rotation_gets_nothing_and_forgets_its_cache():
    policy = CacheAwarePolicy([A, B])
    assert _urls(policy, [SYSTEM]) == [A]
    policy.mark_down(policy.worker(A))
    assert _urls(policy, [SYSTEM, SYSTEM]) == [B, B]
    assert policy.worker(A).tree.size == 0
    policy.mark_up(policy.worker(A))
    assert _urls(policy, [SYSTEM, "new"]) == [B, A]  # B holds the prefix; A is back for new text
    assert policy.route(SYSTEM, exclude=frozenset({B})).url == A
    policy.mark_down(policy.worker(A))
    policy.mark_down(policy.worker(B))
    with pytest.raises(NoHealthyWorker):
        policy.route(SYSTEM)


def test_round_robin_takes_each_healthy_worker_in_turn_whatever_the_text():
    policy = CacheAwarePolicy([A, B, C], PolicyConfig(round_robin=True))
    assert _urls(policy, [SYSTEM, SYSTEM, SYSTEM, SYSTEM]) == [A, B, C, A]
    policy.mark_down(policy.worker(C))
    assert _urls(policy, [SYSTEM, SYSTEM, SYSTEM]) == [B, A, B]
    assert _urls(policy, [SYSTEM], finish=False) == [A]
    assert policy.route(SYSTEM, exclude=frozenset({B})).url == A  # the next in turn is B, excluded: A
    assert [w.cache_routed for w in policy.workers] == [0, 0, 0]


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="at least one worker"):
        CacheAwarePolicy([])
    with pytest.raises(ValueError, match="listed twice"):
        CacheAwarePolicy([A, A])
    with pytest.raises(ValueError, match="cache_threshold"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        PolicyConfig(balance_rel_threshold=0.5)


def test_the_routing_text_of_each_request_shape():
    from ember.router.app import routing_text

    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}
    assert routing_text(chat) == "<system>Be brief.\n<user>Hi there\n"
    assert routing_text({"prompt": "Once"}) == "Once"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    assert routing_text({"prompt": [1, 2, 3]}) == "1 2 3"
    assert routing_text({"prompt": [[4, 5], [6]]}) == "4 5"
    assert [routing_text(x) for x in [None, [], {"prompt": None}, {"messages": "x"}, {"prompt": []}]] == [""] * 5


@pytest.mark.parametrize("args, message", [
    (["--worker", "http://a", "--worker", "http://a"], "a worker is listed twice"),
    (["--worker", "http://a", "--cache-threshold", "2"], "cache_threshold must be in [0, 1]"),
    ([], "the following arguments are required: --worker"),
])
def test_the_router_refuses_bad_flags_before_listening(args, message, capsys):
    from ember.server.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["router", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err, err


# ---- end to end: two `ember serve` workers behind `ember router` --------------------------

LONG_SYSTEM = ("You are the archivist of a small mountain library. You answer questions about the books, the "
               "opening hours (nine to five, closed on Sundays), the reading room rules (no food, quiet voices) "
               "and the history of the building, which was a school until 1961. Keep every answer short.")
OTHER_SYSTEM = "You are a pirate. Speak like one."


class RouterProcess:
    """`ember router` in a subprocess, in front of `workers`."""

    def __init__(self, workers: list, log, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "ember.server.cli", "router", "--port", str(self.port),
               *[a for w in workers for a in ("--worker", w.url)], *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"the router was not ready within {timeout} s:\n{self.log.read_text()}")

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def stats(self) -> list[dict]:
        return httpx.get(f"{self.url}/router/stats", timeout=10).json()["workers"]

    def routed(self) -> list[int]:
        return [w["routed"] for w in self.stats()]


@pytest.fixture(scope="module")
def workers(gguf_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router")
    ws = [Server(gguf_path, logs / f"worker{i}.log", "--api-key", KEY) for i in range(2)]
    try:
        for w in ws:
            w.wait_ready()
        yield ws
    finally:
        for w in ws:
            w.stop()


def _router(workers: list, tmp_path_factory, *args: str):
    r = RouterProcess(workers, tmp_path_factory.mktemp("router") / "router.log", *args)
    try:
        r.wait_ready()
        yield r
    finally:
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(30) == 0, r.log.read_text()


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    yield from _router(workers, tmp_path_factory, "--health-check-interval", "0.5", "--health-check-timeout", "2")


@pytest.fixture(scope="module")
def unaware_router(workers, tmp_path_factory):
    """Checks health once an hour, and lists worker 1 first."""
    yield from _router(workers[::-1], tmp_path_factory, "--health-check-interval", "3600")


def _chat(client, system: str, *turns: str, **kw) -> str:
    messages = [{"role": "system", "content": system}] + [{"role": "user", "content": t} for t in turns]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, **kw)
    return out.choices[0].message.content


def _after(router: RouterProcess, before: list[int]) -> list[int]:
    return [a - b for a, b in zip(router.routed(), before)]


@pytest.mark.slow
def test_answers_through_the_router_equal_the_workers_own(router, workers):
    client = router.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    direct = [_chat(w.client(), LONG_SYSTEM, "When do you open?") for w in workers]
    assert direct[0] == direct[1] and direct[0]
    assert _chat(client, LONG_SYSTEM, "When do you open?") == direct[0]
    stream = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, stream=True,
                                            messages=[{"role": "system", "content": LONG_SYSTEM},
                                                      {"role": "user", "content": "When do you open?"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == direct[0]
    text = workers[1].client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                                  temperature=0).choices[0].text
    assert client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                     temperature=0).choices[0].text == text == " Paris.\n\n"
    # idle workers: the first request to the first listed, the same prefix again to it, new text to the other
    assert router.routed() == [2, 1]
    assert [w["in_flight"] for w in router.stats()] == [0, 0]
    # the worker's own errors come back as they are
    r = httpx.post(f"{router.url}/v1/chat/completions", json={"model": MODEL, "messages": []},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert_openai_error(r, 400)
    assert httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                      timeout=30).status_code == 401
    r = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert_openai_error(r, 400)
    assert_openai_error(httpx.get(f"{router.url}/nowhere"), 404)
    # the worker's headers pass, those of the connection do not (one date, one server)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{router.url}/v1/completions", json=body, headers=auth, timeout=30)
    assert r.headers["content-type"] == "application/json" and int(r.headers["content-length"]) == len(r.content)
    assert [len(r.headers.get_list(h)) for h in ("date", "server")] == [1, 1]
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body | {"stream": True}, headers=auth) as r:
        assert r.headers["content-type"].startswith("text/event-stream") and r.read().endswith(b"data: [DONE]\n\n")
        assert [len(r.headers.get_list(h)) for h in ("date", "server")] == [1, 1]


@pytest.mark.slow
def test_a_shared_prefix_goes_to_the_worker_that_holds_it(router, workers):
    client = router.client()
    hits = [w.metrics()["prefix_cache_hits_total"] for w in workers]
    before = router.routed()
    _chat(client, OTHER_SYSTEM, "Where is the treasure? " * 8)  # new text: the worker with less of it, 1
    assert _after(router, before) == [0, 1]
    _chat(client, OTHER_SYSTEM, "Where is the treasure? " * 8, "And the map?")
    assert _after(router, before) == [0, 2]
    _chat(client, LONG_SYSTEM, "Is the reading room quiet?")  # the library prompt lives on worker 0
    assert _after(router, before) == [1, 2]
    gained = [w.metrics()["prefix_cache_hits_total"] - h for w, h in zip(workers, hits)]
    assert gained[0] >= 48 and gained[1] >= 48, gained  # each follow-up found its prefix in its worker's cache


@pytest.mark.slow
def test_a_client_that_leaves_frees_its_worker(router, workers):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6000, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):  # an answer, awaited
        httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=1.5)
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=30) as r:
        assert next(r.iter_lines()).startswith("data: {")  # a stream, left after its first event
    deadline = time.monotonic() + 5
    while any(w["in_flight"] for w in router.stats()):
        assert time.monotonic() < deadline, router.stats()
        time.sleep(0.05)
    for w in workers:
        w.wait_idle()


@pytest.mark.slow
def test_a_dead_worker_fails_its_requests_cleanly_and_the_other_takes_the_rest(router, unaware_router, workers):
    client = router.client()
    messages = [{"role": "system", "content": OTHER_SYSTEM},
                {"role": "user", "content": "Where is the treasure? " * 8}, {"role": "user", "content": "Sing!"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2000,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    assert [w["in_flight"] for w in router.stats()] == [0, 1]  # pinned to worker 1, which holds the prefix
    workers[1].proc.kill()
    start = time.monotonic()
    with pytest.raises(openai.APIError, match=f"the worker {workers[1].url} failed during the request"):
        for _ in chunks:
            pass
    assert time.monotonic() - start < 10
    stats = router.stats()
    assert [(w["healthy"], w["in_flight"]) for w in stats] == [(True, 0), (False, 0)]
    # the next requests, the same conversation included, go to worker 0 and get its answers
    before = router.routed()
    direct = _chat(workers[0].client(), OTHER_SYSTEM, "Where is the treasure? " * 8, "And the map?")
    assert _chat(client, OTHER_SYSTEM, "Where is the treasure? " * 8, "And the map?") == direct
    assert _chat(client, "Hello") and _after(router, before) == [2, 0]
    assert httpx.get(f"{router.url}/health").status_code == 200
    # a router that has not noticed: the request is refused by worker 1, then answered by worker 0
    assert [w["healthy"] for w in unaware_router.stats()] == [True, True]
    assert _chat(unaware_router.client(), OTHER_SYSTEM, "Where is the treasure? " * 8, "And the map?") == direct
    assert [(w["healthy"], w["routed"], w["in_flight"]) for w in unaware_router.stats()] == [(False, 1, 0),
                                                                                            (True, 1, 0)]
    # a worker that hangs (its /health times out) fails its running requests, and is back once it answers
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    workers[0].proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(openai.APIError, match=f"the worker {workers[0].url} failed during the request "
                                                  r"\(it stopped answering\)"):
            for _ in chunks:
                pass
        assert time.monotonic() - start < 10
        assert [(w["healthy"], w["in_flight"]) for w in router.stats()] == [(False, 0), (False, 0)]
    finally:
        workers[0].proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{router.url}/health").status_code != 200:
        assert time.monotonic() < deadline, router.stats()
        time.sleep(0.1)
    assert _chat(client, OTHER_SYSTEM, "Where is the treasure? " * 8, "And the map?") == direct
    # the last worker stops: the router says so
    assert workers[0].stop() == 0
    deadline = time.monotonic() + 10
    while httpx.get(f"{router.url}/health").status_code != 503:
        assert time.monotonic() < deadline, router.stats()
        time.sleep(0.1)
    r = httpx.post(f"{router.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert_openai_error(r, 503, "no healthy worker", workers[0].url, workers[1].url)
    assert httpx.get(f"{router.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 503
