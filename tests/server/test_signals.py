"""How `ember serve` ends: SIGTERM / SIGINT while the model loads, requests still running
past --shutdown-timeout, and an engine loop that dies. Each on its own real server process;
the exit code and what every client received are checked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from servers import MODEL, Server, assert_openai_error

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
LONG = {"model": MODEL, "prompt": FRANCE, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


def test_sigterm_while_the_model_loads_exits_cleanly_and_quickly(gguf_path, tmp_path):
    """(SIGINT takes the same path: uvicorn handles both the same way, then run_server.)"""
    s = Server(gguf_path, tmp_path / "server.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # listening, still loading
        try:
            if httpx.get(f"{s.url}/health", timeout=2).status_code == 503:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    else:
        pytest.fail(f"never saw /health 503 while loading:\n{s.log_tail()}")
    s.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    code = s.proc.wait(20)
    assert code == 0, s.log_tail()
    assert time.monotonic() - start < 10
    log = s.log.read_text()
    assert "terminate called" not in log and "Traceback" not in log, log


def _stream_lines(url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_requests_past_the_shutdown_timeout_get_an_error_then_exit_0(gguf_path, tmp_path):
    s = Server(gguf_path, tmp_path / "server.log", "--shutdown-timeout", "1")
    s.wait_ready()
    lines: list[str] = []
    started = threading.Event()
    streamer = threading.Thread(target=_stream_lines, args=(s.url, LONG, lines, started), daemon=True)
    streamer.start()
    answer: list[httpx.Response] = []
    plain = threading.Thread(target=lambda: answer.append(httpx.post(f"{s.url}/v1/completions", json=LONG,
                                                                      timeout=120)), daemon=True)
    plain.start()
    assert started.wait(60)
    time.sleep(0.5)  # both run
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, s.log_tail()
    streamer.join(10)
    plain.join(10)
    error = assert_openai_error(answer[0], 503, "shutting down", "shutdown timeout (1 s)")
    assert error["type"] == "server_error"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    assert set(last) == {"error"} and "shutting down" in last["error"]["message"], last
    assert all("error" not in json.loads(x.removeprefix("data: ")) for x in lines[:-2])  # text until then


def test_a_dead_engine_loop_fails_its_clients_and_exits_non_zero(gguf_path, tmp_path):
    """The engine loop dies (a fault injected into EngineCore.step, so the core runs in the
    server's process: --no-core-process): the client in flight gets a 503 in OpenAI's shape,
    /health says so, and the process exits 1 for its supervisor. (A killed core process:
    tests/server/test_core_process_server.py.)"""
    script = ("import sys, ember.engine.core as core\n"
              "def boom(self):\n"
              "    raise RuntimeError('injected')\n"
              "core.EngineCore.step = boom\n"
              "from ember.server.cli import main\n"
              "main(sys.argv[1:])\n")
    s = Server(gguf_path, tmp_path / "server.log", "--no-core-process")
    s.proc.kill()  # the same command line, with the fault
    s.proc.wait()
    cmd = [sys.executable, "-c", script, *s.proc.args[3:]]
    s.proc = subprocess.Popen(cmd, stdout=s.log.open("w"), stderr=subprocess.STDOUT)
    s.wait_ready()
    r = httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": FRANCE, "max_tokens": 4}, timeout=60)
    error = assert_openai_error(r, 503, "the engine loop died")
    assert "injected" not in error["message"]  # the exception stays in the log
    assert s.proc.wait(30) == 1, s.log_tail()
    assert "the engine loop died" in s.log.read_text()
