"""Cache-aware routing against round-robin, on the CPU: N `ember serve` replicas of the
default model (one thread each), `ember router --policy P` in front, and `ember bench serve`'s
multi-turn shared-prefix workload through the router. The replicas start fresh for each
policy. Reports the client's throughput and TTFT, and the prefix-cache hit rate summed over
the replicas' /metrics (tokens found in the cache / tokens looked up).

    python3 benchmarks/scripts/router_bench.py --replicas 2 [--conversations 16 --turns 5
        --shared-prefix-len 64 --turn-input-len 128 --output-len 32] [--output-json FILE]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from ember.distributed.parallel_state import free_port
from ember.server.data_parallel import wait_ready

CLI = [sys.executable, "-m", "ember.server.cli"]


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r"^ember:prefix_cache_(queries|hits)_total\{[^}]*\} (\S+)$"
    found = {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}
    return found.get("queries", 0.0), found.get("hits", 0.0)


def run_policy(policy: str, ns: argparse.Namespace, logs: Path) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for i in range(ns.replicas):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(subprocess.Popen([*CLI, "serve", "--port", str(port), "--served-model-name", "smol",
                                           *ns.serve_args.split()],
                                          stdout=(logs / f"{policy}-replica{i}.log").open("w"),
                                          stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"}))
        wait_ready(procs, urls, timeout=300)
        port = free_port()
        router = f"http://127.0.0.1:{port}"
        procs.append(subprocess.Popen([*CLI, "router", "--port", str(port), "--policy", policy,
                                       *[a for u in urls for a in ("--worker", u)]],
                                      stdout=(logs / f"{policy}-router.log").open("w"), stderr=subprocess.STDOUT))
        wait_ready(procs[-1:], [router], timeout=300)
        out = logs / f"{policy}.json"
        subprocess.run([*CLI, "bench", "serve", "--base-url", router, "--dataset", "shared-prefix",
                        "--num-prompts", str(ns.conversations), "--num-turns", str(ns.turns),
                        "--shared-prefix-len", str(ns.shared_prefix_len), "--turn-input-len", str(ns.turn_input_len),
                        "--random-output-len", str(ns.output_len), "--ignore-eos", "--label", policy,
                        "--output-json", str(out)], check=True, stdout=subprocess.DEVNULL)
        results = json.loads(out.read_text())["results"]
        queries, hits = map(sum, zip(*(prefix_counters(u) for u in urls)))
        routed = [w["routed"] for w in httpx.get(f"{router}/router/stats", timeout=10).json()["workers"]]
        return {"policy": policy, "output_throughput": results["output_throughput"],
                "total_token_throughput": results["total_token_throughput"], "duration_s": results["duration_s"],
                "mean_ttft_ms": results["mean_ttft_ms"], "later_turns_mean_ttft_ms": results["later_turns_mean_ttft_ms"],
                "failed": results["failed"], "prefix_hit_rate": hits / max(queries, 1.0), "routed": routed}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--shared-prefix-len", type=int, default=64)
    ap.add_argument("--turn-input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--serve-args", default="", help="more `ember serve` flags for every replica")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="router-bench-"))
    rows = [run_policy(p, ns, logs) for p in ("round-robin", "cache-aware")]
    rr, ca = rows
    for r in rows:
        print(f"{r['policy']:>12}: {r['output_throughput']:7.1f} out tok/s, {r['total_token_throughput']:7.1f} total, "
              f"{r['duration_s']:6.1f} s, TTFT {r['mean_ttft_ms']:7.0f} ms (later turns "
              f"{r['later_turns_mean_ttft_ms']:7.0f}), prefix hit rate {100 * r['prefix_hit_rate']:5.1f} %, "
              f"routed {r['routed']}, failed {r['failed']}")
    print(f"cache-aware / round-robin: throughput {ca['output_throughput'] / rr['output_throughput']:.2f}x, "
          f"hit rate {ca['prefix_hit_rate'] / max(rr['prefix_hit_rate'], 1e-9):.2f}x  (logs: {logs})")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"config": vars(ns), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
