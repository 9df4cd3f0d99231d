"""What a client is told when its request fails inside the engine, on a real uvicorn server
in this process (so that a fault can be injected into the engine it serves): a 500 in
OpenAI's shape with a message that names no internals, or for a stream an error event and
[DONE]; everyone else is served. Also: /metrics without the key under --metrics-public,
and failed requests counted."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from servers import assert_openai_error

from ember import EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine
from ember.server.openai_api import ServerConfig, build_app

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

KEY = "k"
FRANCE = "The capital of France is"
DOOMED_SEED = 666  # the injected fault hits requests with this seed


@pytest.fixture(scope="module")
def served(gguf_path):
    """(base url, engine): a keyed server with public metrics on an engine whose sampling
    rows fail for seed DOOMED_SEED."""
    engine = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", num_kv_blocks=128))
    generator = engine.core.runner._generator

    def doomed(req, i):
        if req.sampling_params.seed == DOOMED_SEED:
            raise RuntimeError("injected /secret/path")
        return generator(req, i)

    engine.core.runner._generator = doomed
    config = ServerConfig(engine.config, ("smol",), api_keys=(KEY,), metrics_public=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(config, engine), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    yield url, engine
    server.should_exit = True
    thread.join(30)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_a_request_that_fails_in_the_engine_gets_a_500_without_internals(served):
    url, _ = served
    r = _post(url, "/v1/completions", {"prompt": FRANCE, "max_tokens": 8, "seed": DOOMED_SEED})
    error = assert_openai_error(r, 500, "the request failed while generating")
    assert error["message"] == ("the request failed while generating: its sampling parameters could not be "
                                "applied (RuntimeError)")
    assert "secret" not in r.text and error["type"] == "server_error"


def test_a_stream_that_fails_in_the_engine_ends_with_an_error_event_and_done(served):
    url, _ = served
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True,
                            "seed": DOOMED_SEED}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["message"].startswith("the request failed while generating") and error["code"] == 500


def test_the_others_are_served_and_failures_are_counted(served, llm):
    url, engine = served
    want = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    before = _errors(url)
    results: dict[str, httpx.Response] = {}
    threads = [threading.Thread(target=lambda k=k, b=b: results.__setitem__(k, _post(url, "/v1/completions", b)))
               for k, b in [("good", {"prompt": FRANCE, "max_tokens": 8, "temperature": 0}),
                            ("bad", {"prompt": FRANCE, "max_tokens": 8, "seed": DOOMED_SEED})]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["good"].json()["choices"][0]["text"] == want
    assert results["bad"].status_code == 500
    assert _errors(url) == before + 1
    assert engine.core.block_pool.num_in_use == 0


def test_metrics_public_opens_metrics_alone(served):
    url, _ = served
    assert httpx.get(f"{url}/metrics").status_code == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/v1/completions")]:
        assert_openai_error(httpx.request(method, f"{url}{path}", json={}), 401, "API key")


def _errors(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r'^ember:request_success_total\{finished_reason="error",[^}]*\} (\S+)$', text,
                           re.MULTILINE).group(1))
