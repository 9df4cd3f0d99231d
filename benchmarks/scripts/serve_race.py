"""`vllm serve` and `ember serve` on the same model directory, one after the other in one
device call, driven by vLLM's own client (`vllm bench serve`) on the workloads of
BENCHMARKS.md's serving table; with each run, the CPU seconds that the API side (the
server's process; with ember's --api-server-count, every process but the core's) and the
engine core (with its children) spent per output token.

    python3 benchmarks/scripts/serve_race.py MODEL_DIR --out DIR [--servers vllm,ember]
        [--workloads burst,rate16,prefix,one] [--ember-flags "..."] [--vllm-flags "..."]
        [--max-model-len N] [--tag NAME] [--deadline S]

The vision workloads (issue #39, a Qwen2.5-VL directory: served_model.py --vl) are driven by
ember's client (`ember bench serve --dataset images`, the same seeded bytes to both servers):
`images`, 256 chat requests at once of one 1024x768 random image and 128 text tokens, 128 out;
`images-shared`, the same with one image in every request; `random-mm`, vLLM's client on its
random-mm dataset at the same sizes (the image after the text), a cross-check of the first.

vLLM must be installed under /tmp/vllm-site (h200.sh's have_vllm); ember's server wheels on
PYTHONPATH (serve_kit). Each workload's vLLM JSON lands in DIR/<server>_<workload>.json, one
RESULT line per run goes to stdout and all of them to DIR/serve_race.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

COMMON = ["--load-format", "dummy", "--seed", "0"]
VLLM_ENV = {"PYTHONPATH": "/tmp/vllm-site", "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
WORKLOADS = {
    "burst": ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
              "--num-prompts", "256", "--request-rate", "inf"],
    "rate16": ["--dataset-name", "random", "--random-input-len", "1000", "--random-output-len", "200",
               "--num-prompts", "512", "--request-rate", "16"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1536",
               "--prefix-repetition-suffix-len", "256", "--prefix-repetition-num-prefixes", "8",
               "--prefix-repetition-output-len", "128", "--num-prompts", "512", "--request-rate", "32"],
    "one": ["--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "512",
            "--num-prompts", "1"],
}
IMAGES = ["--dataset", "images", "--num-prompts", "256", "--image-width", "1024", "--image-height", "768",
          "--random-input-len", "128", "--random-output-len", "128", "--request-rate", "inf"]
EMBER_CLIENT = {"images": IMAGES, "images-shared": [*IMAGES, "--shared-image"]}
WORKLOADS["random-mm"] = [
    "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm",
    "--random-input-len", "128", "--random-output-len", "128", "--random-range-ratio", "0",
    "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
    "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}', "--random-mm-bucket-config", "{(768, 1024, 1): 1.0}",
    "--num-prompts", "256", "--request-rate", "inf"]
TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            pass
    return out


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except FileNotFoundError:
        return 0.0


def engine_core_tree(log: Path, pid: int) -> set[int]:
    """The engine core's process and its descendants: ember names it in its log (with
    --api-server-count its API processes are children of the launcher too, and count as the
    API side); otherwise (vLLM) every descendant of the server's process `pid`."""
    found = re.search(r"the engine core runs in process (\d+)", log.read_text(errors="replace"))
    return set(tree(int(found.group(1)))) if found else set(tree(pid)) - {pid}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def start(server: str, model: str, port: int, flags: list[str], log: Path, max_model_len: int,
          common: list[str] = COMMON) -> subprocess.Popen:
    common = [*common, "--max-model-len", str(max_model_len)]
    if server == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port), *common, *flags]
        env = os.environ | VLLM_ENV
    else:
        cmd = [sys.executable, "-m", "ember.server.cli", "serve", model, "--port", str(port), *common, *flags]
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
    print(f"== {server}: {shlex.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def run_client(model: str, port: int, workload: str, out: Path, name: str, timeout: float) -> dict | None:
    """One workload's run by its client (vLLM's, or ember's for EMBER_CLIENT's); its metrics."""
    url = f"http://127.0.0.1:{port}"
    if workload in EMBER_CLIENT:
        cmd = [sys.executable, "-m", "ember.server.cli", "bench", "serve", "--base-url", url, "--model", model,
               "--tokenizer", model, "--seed", "0", "--ignore-eos", "--label", name,
               "--output-json", str(out / f"{name}.json"), *EMBER_CLIENT[workload]]
        env = dict(os.environ)
    else:
        # the client's openai backend on /v1/completions unless the workload names its own
        backend = [] if "--backend" in WORKLOADS[workload] else ["--backend", "openai", "--endpoint", "/v1/completions"]
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *backend, "--model", model,
               "--tokenizer", model, "--base-url", url, "--seed", "0", "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json", *WORKLOADS[workload]]
        env = os.environ | VLLM_ENV
    with (out / f"{name}.client.log").open("w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"== {name}: the client ran past {timeout:.0f} s", flush=True)
            return None
    path = out / f"{name}.json"
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    return r["results"] if workload in EMBER_CLIENT else r


@contextlib.contextmanager
def serving(server: str, model: str, port: int, flags: list[str], log: Path, max_model_len: int, deadline: float,
            tag: str, common: list[str] = COMMON) -> Iterator[subprocess.Popen | None]:
    """`vllm serve` / `ember serve` (start()) until it answers /health 200: the process, or None (its
    log's tail printed) when it exits first or `deadline` (time.monotonic()) passes; stopped on exit."""
    proc = start(server, model, port, flags, log, max_model_len, common)
    began = time.monotonic()
    try:
        while not healthy(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"== {tag}: no /health 200 ({'exited' if proc.poll() is not None else 'out of time'})")
                print(log.read_text()[-3000:])
                yield None
                return
            time.sleep(1)
        print(f"== {tag}: ready after {time.monotonic() - began:.0f} s", flush=True)
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"== {tag}: stopped (exit {proc.returncode})", flush=True)


def race(server: str, args, out: Path, results: list[dict], deadline: float) -> None:
    port = 8200 if server == "vllm" else 8300
    flags = shlex.split(args.ember_flags) if server == "ember" else shlex.split(args.vllm_flags)
    tag = f"{server}{('_' + args.tag) if args.tag and server == 'ember' else ''}"
    log = out / f"{tag}.server.log"
    with serving(server, args.model, port, flags, log, args.max_model_len, deadline, tag) as proc:
        if proc is None:
            return
        for workload in args.workloads.split(","):
            left = deadline - time.monotonic()
            if left < 20:
                print(f"== {tag} {workload}: skipped, the call's time is spent")
                continue
            pids = tree(proc.pid)
            before = {p: cpu_seconds(p) for p in pids}
            t0 = time.monotonic()
            r = run_client(args.model, port, workload, out, f"{tag}_{workload}", left - 10)
            wall = time.monotonic() - t0
            if r is None:
                continue
            cpu = {p: cpu_seconds(p) - before[p] for p in pids}
            tokens = max(1, r.get("total_output_tokens", 0))
            core = engine_core_tree(log, proc.pid)
            api = sum(v for p, v in cpu.items() if p not in core)
            rest = sum(v for p, v in cpu.items() if p in core)
            row = {"server": tag, "workload": workload, "output_throughput": r.get("output_throughput"),
                   "completed": r.get("completed"), "wall_s": round(wall, 1),
                   "api_cpu_ms_per_token": round(1000 * api / tokens, 4),
                   "children_cpu_ms_per_token": round(1000 * rest / tokens, 4)}
            for k in ("server_prompt_tokens", "failed", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                      "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms"):
                if k in r:
                    row[k] = round(r[k], 2)
            results.append(row)
            print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--servers", default="vllm,ember")
    ap.add_argument("--workloads", default="burst,rate16,prefix,one")
    ap.add_argument("--ember-flags", default="")
    ap.add_argument("--vllm-flags", default="")
    ap.add_argument("--max-model-len", type=int, default=2048, help="both servers'")
    ap.add_argument("--tag", default="", help="a name for this ember configuration (file names)")
    ap.add_argument("--deadline", type=float, default=560, help="seconds from now by which every run has ended")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline
    results: list[dict] = []
    path = args.out / "serve_race.json"
    if path.exists():
        results = json.loads(path.read_text())
    for server in args.servers.split(","):
        race(server, args, args.out, results, deadline)
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
