"""The longest /health answer while one hostile request is sent, for each of the
fault-injection tests' hostile requests: /health is polled every 20 ms from its own
process, so what is measured is the server's event loop.

    ember serve --dtype float32 --port 8011 --served-model-name smol &
    python benchmarks/scripts/health_stalls.py http://127.0.0.1:8011
"""

import json
import subprocess
import sys
import time

import httpx

sys.path.insert(0, "tests/server")
from test_fault_injection import _POLLER as POLL  # noqa: E402
from test_fault_injection import HOSTILE, MODEL

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011"
for name, (path, body), _, _ in HOSTILE:
    body = json.dumps(dict(body, model=body.get("model", MODEL)))
    poller = subprocess.Popen([sys.executable, "-c", POLL, url], stdout=subprocess.PIPE, text=True)
    time.sleep(0.6)
    start = time.time()
    r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=120)
    elapsed = time.time() - start
    time.sleep(0.2)
    poller.terminate()
    out, _ = poller.communicate()
    slowest = max(float(line.split()[1]) for line in out.splitlines()[:-1])  # the last may be cut short
    print(f"{name:40s} {len(body) / 2**20:5.2f} MiB  {r.status_code}  {elapsed:5.2f} s  /health max {slowest * 1e3:.0f} ms")
