"""What the server tests share: a real `ember serve` (uvicorn on 127.0.0.1, in a subprocess)
on the default model in float32, the constants its tests send, and OpenAI's error shape.
The `server`, `client` and `still_serving` fixtures on it are in conftest.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "smol"
KEY = "test-key"
FRANCE = "The capital of France is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, gguf: Path, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "ember.server.cli", "serve", str(gguf), "--dtype", "float32", "--quantization", "none",
               "--port", str(self.port), "--served-model-name", MODEL, *args]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=os.environ | {"PYTHONUNBUFFERED": "1"})
        self.health_seen: list[int] = []

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                code = httpx.get(f"{self.url}/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            self.health_seen.append(code)
            if code == 200:
                return
            time.sleep(0.2)
        pytest.fail(f"the server was not ready within {timeout} s:\n{self.log_tail()}")

    def wait_api_servers(self, count: int, timeout: float = 120) -> None:
        """Until each of `count` API processes (--api-server-count) has answered /health with
        200 (each attaches to the core on its own: the first answers before the last has)."""
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        while len(ready) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"only API servers {sorted(ready)} were ready within {timeout} s:\n{self.log_tail()}")
            r = httpx.get(f"{self.url}/health", timeout=5)  # a connection of its own: any process may take it
            if r.status_code == 200:
                ready.add(r.headers["x-ember-api-server"].split()[0])

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])

    def client(self, api_key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        """{'name' or 'name{other="labels"}': value} of every ember: sample (model_name left out)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, headers={"Authorization": f"Bearer {KEY}"}).text
        samples = {}
        for m in re.finditer(r"^ember:(\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
            labels = [x for x in m.group(2).split(",") if x and not x.startswith("model_name=")]
            assert f'model_name="{MODEL}"' in m.group(2)
            samples[m.group(1) + (f"{{{','.join(labels)}}}" if labels else "")] = float(m.group(3))
        return samples

    def wait_idle(self, timeout: float = 20) -> dict[str, float]:
        """Until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["num_requests_running"] == m["num_requests_waiting"] == m["kv_cache_usage_perc"] == 0:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"the engine is not idle after {timeout} s: {m}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def running(s: Server):
    """A module's server (`yield from` it in a fixture): ready, then stopped with SIGTERM,
    after which it must exit 0."""
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
    assert code == 0, f"the server exited with {code} after SIGTERM:\n{s.log_tail()}"


def serving(gguf_path, tmp_path_factory, *args: str):
    """`running` on the default model, with the API key and `args`."""
    yield from running(Server(gguf_path, tmp_path_factory.mktemp("server") / "server.log", "--api-key", KEY, *args))


def post(server: Server, path: str, body, headers: dict | None = None) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=data, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json",
                               **(headers or {})})


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    for w in words:
        assert w in error["message"], error["message"]
    return error
