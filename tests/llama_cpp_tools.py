"""llama.cpp's own tools as references for tests (llama-cpp-python 0.3.36's llama.cpp, built by
../shared/peers/llama-cpp): where each tool is, and its llama-server's greedy output.

    tool("llama-server", "EMBER_LLAMA_SERVER")   # the path the variable names, else the peers' build
    greedy(tool, gguf, prompts, max_tokens, ctx, log_dir)   # -> LlamaCppGreedy

The fixtures in conftest.py wrap these (skipping where a tool is not built);
models/llama_cpp_reference.py records their output for CI, which has no llama.cpp build.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"


def build_dir(cpu_flags: str | None = None) -> Path:
    """Where ../shared/peers/llama-cpp builds llama.cpp on this CPU (its BUILD rule, which
    `peers/llama-cpp build` prints as .../bin): build/, or build-noamx/ on a CPU whose flags
    list amx_tile, where a native build crashes on every prompt batch. `cpu_flags`: a flags
    line as /proc/cpuinfo's (default: this CPU's)."""
    if cpu_flags is None:
        info = Path("/proc/cpuinfo")
        text = info.read_text() if info.exists() else ""
        cpu_flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    peers = Path(os.environ.get("EMBER_PEERS") or Path.home() / ".cache" / "ember-peers")
    return peers / f"llama.cpp-{VERSION}" / ("build-noamx" if "amx_tile" in cpu_flags.split() else "build")


def tool(name: str, env: str) -> Path:
    """The path `env` names, else the tool in the peers' build for this CPU (build_dir); it
    may not exist."""
    return Path(os.environ.get(env) or build_dir() / "bin" / name)


@dataclass(frozen=True)
class LlamaCppGreedy:
    tokens: list[list[int]]  # each prompt's
    end_of_generation: frozenset[int]  # as llama.cpp's log lists them


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"llama-server answered {e.code} to {body}: {e.read()[:1000]!r}") from None


def greedy(server_tool: Path, gguf_path: Path, prompts: list[list[int]], max_tokens: int, ctx: int,
           log_dir: Path, ignore_eos: bool = False) -> LlamaCppGreedy:
    """Each prompt's greedy tokens from llama.cpp's llama-server on the file (127.0.0.1, a
    context of `ctx` tokens, one slot, one thread, no prompt cache), and the ids it ends
    generation at. Prompts are token ids (the server adds no BOS to them); a completion stops
    at an end-of-generation token, which it includes, or after max_tokens. ignore_eos:
    llama.cpp's, which pushes those tokens out of the argmax."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(log_dir) / f"{Path(gguf_path).stem}-{port}.log"
    # one thread: with two, a request took seconds where the shared 2-core machine was busy
    # (they wait on each other at every step); -lv 4 logs the end-of-generation tokens
    cmd = [str(server_tool), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port), "-t", "1",
           "-c", str(ctx), "-np", "1", "--cache-ram", "0", "--no-webui", "--no-warmup", "-lv", "4"]
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up on {gguf_path}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):  # not listening yet, or 503 while loading
                pass
            time.sleep(0.1)
        body = {"n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "ignore_eos": ignore_eos, "return_tokens": True}
        tokens = [_post(base + "/completion", body | {"prompt": ids})["tokens"] for ids in prompts]
        eog = re.findall(r"print_info: EOG token += (\d+) '", log.read_text(errors="replace"))
        if not eog:
            raise RuntimeError(f"llama-server's log ({log}) lists no 'EOG token': has its format changed?")
        return LlamaCppGreedy(tokens, frozenset(int(i) for i in eog))
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def assert_greedy_agrees(outputs, theirs: list[list[int]], gap: float = 1e-3) -> None:
    """ember's greedy outputs (asked with logprobs >= 5) against llama.cpp's tokens: equal, or
    equal up to a position where the two picks are a near-tie in ember's own logprobs (within
    `gap` nats: float32 sums in another order pick the other one of a tiny random model's nearly
    flat top two); after such a position the texts go their own ways and are not compared."""
    for i, (out, want) in enumerate(zip(outputs, theirs, strict=True)):
        got = list(out.outputs[0].token_ids)
        at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if at is None:
            assert len(got) == len(want), f"prompt {i}: {len(got)} tokens against llama.cpp's {len(want)}"
            continue
        mine = out.outputs[0].logprobs[at]
        assert want[at] in mine, f"prompt {i}, token {at}: llama.cpp's {want[at]} is not in ember's top tokens"
        assert mine[got[at]].logprob - mine[want[at]].logprob < gap, \
            f"prompt {i}, token {at}: ember's {got[at]} beats llama.cpp's {want[at]} by more than a near-tie"
