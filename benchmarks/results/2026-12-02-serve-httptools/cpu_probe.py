"""the CPU numbers of the entry: served tok/s with a tiny model (benchmarks/scripts/served_model.py, then 2 layers, hidden 64) on the CPU, and each server thread's CPU during the run; toggle httptools / uvloop by (un)installing them"""
import json
import os
import subprocess
import sys
import time

import httpx

name = sys.argv[1]; extra = sys.argv[2:]
PY = "/work/main/.venv/bin/python"; port = 8199
tree = os.environ.get("TREE", "/work/main")
env = dict(os.environ, PYTHONPATH=tree)
srv = subprocess.Popen([PY, "-m", "ember.server.cli", "serve", "/tmp/probe-model", "--port", str(port), "--load-format", "dummy",
                        "--dtype", "float32", "--seed", "0", "--max-model-len", "1024", "--max-num-seqs", "256",
                        "--max-num-batched-tokens", "4096", "--uvicorn-log-level", "warning", *extra],
                       cwd=tree, env=env, stdout=open(f"/tmp/probe/{name}.server.log", "w"), stderr=subprocess.STDOUT)
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200: break
    except Exception: pass
    time.sleep(0.5)
def cpu():
    tk = os.sysconf("SC_CLK_TCK"); out = {}
    for t in os.listdir(f"/proc/{srv.pid}/task"):
        f = open(f"/proc/{srv.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
        out[int(t)] = (int(f[11]) + int(f[12])) / tk
    return out
before = cpu()
n = int(os.environ.get("N", 256)); olen = int(os.environ.get("OUTLEN", 256))
subprocess.run([PY, "-m", "ember.server.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", "/tmp/probe-model",
                "--dataset", "random", "--num-prompts", str(n), "--random-input-len", "64", "--random-output-len", str(olen),
                "--ignore-eos", "--seed", "0", "--output-json", f"/tmp/probe/{name}.json"], cwd=tree, env=env,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
after = cpu()
srv.terminate(); srv.wait()
r = json.load(open(f"/tmp/probe/{name}.json"))['results']
chunks = n * olen
main = after[srv.pid] - before.get(srv.pid, 0)
others = sorted(((after[t] - before.get(t, 0)) for t in after if t != srv.pid), reverse=True)[:3]
print(f"{name}: {r.get('output_throughput', 0):.0f} tok/s  main thread {main:.2f} s = {main / chunks * 1e6:.0f} us/chunk  "
      f"other threads {[round(o, 2) for o in others]}")
