import json, subprocess, sys, time, httpx, threading
POLL = """
import sys, time, httpx
with httpx.Client(timeout=30) as client:
    while True:
        start = time.perf_counter()
        code = client.get(sys.argv[1] + "/health").status_code
        print(code, time.perf_counter() - start, flush=True)
        time.sleep(0.02)
"""
url = "http://127.0.0.1:8011"
bodies = {
 "choice-1e-40": {"model": "smol", "prompt": "x", "max_tokens": 8, "temperature": 1e-40, "guided_choice": ["yes", "no"]},
 "regex-a100000": {"model": "smol", "prompt": "x", "max_tokens": 4, "guided_regex": "a{1,100000}"},
 "regex-a100000-again": {"model": "smol", "prompt": "x", "max_tokens": 4, "guided_regex": "a{1,100000}"},
 "bias1024": {"model": "smol", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logit_bias": {str(t): -1.0 for t in range(1000, 2023)}},
 "seed-n2": {"model": "smol", "prompt": "x", "seed": 18446744073709551615, "temperature": 1, "max_tokens": 4, "n": 2},
 "bias-all": {"model": "smol", "prompt": "x", "logit_bias": {str(t): 1 for t in range(49152)}},
 "3MB": {"model": "smol", "prompt": "word " * 600_000},
}
for name, body in bodies.items():
    p = subprocess.Popen([sys.executable, "-c", POLL, url], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    t = time.time(); r = httpx.post(url + "/v1/completions", json=body, timeout=120); el = time.time() - t
    time.sleep(0.3)
    p.terminate(); out, _ = p.communicate()
    lat = [float(l.split()[1]) for l in out.splitlines()]
    print(f"{name:22s} {r.status_code} {el:6.2f}s  health n={len(lat)} max={max(lat)*1000:.0f}ms")
