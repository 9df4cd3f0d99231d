"""Writes data/llama_cpp_greedy.json: llama.cpp's own greedy continuations of PROMPTS on the
default model (SmolLM2-135M-Instruct Q4_1) and on its K-quant conversions, the reference
tests/models/test_quantized_vs_llama_cpp.py compares ember's quantized path with, so that
CI checks it without a llama.cpp build. Run it where the peer is built:

    python tests/models/llama_cpp_reference.py [--quantize Q4_K_M Q6_K ...]

It starts llama.cpp's llama-server (../shared/peers/llama-cpp build; one slot, one thread,
no prompt cache) on each file, sends the prompts as token ids and records the tokens."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a village by the sea,",
    "The three primary colors are",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "The most important thing to remember when learning a new language is",
    "import numpy as np\n\n# compute the mean of",
]
MAX_TOKENS = 64
DATA = Path(__file__).with_name("data") / "llama_cpp_greedy.json"
PEERS = Path(os.environ.get("EMBER_PEERS") or Path.home() / ".cache" / "ember-peers") / "llama.cpp-0.3.36" / "build" / "bin"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def quantized_file(source: Path, qtype: str, folder: Path) -> Path:
    """llama.cpp's llama-quantize of the default Q4_1 file (allowed to requantize) to qtype."""
    out = folder / f"{source.stem.rsplit('.', 1)[0]}.{qtype}.gguf"
    if not out.exists():
        subprocess.run([str(PEERS / "llama-quantize"), "--allow-requantize", str(source), str(out), qtype, "2"],
                       check=True, capture_output=True)
    return out


def greedy(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(PEERS / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                               str(port), "-t", "1", "-c", "1024", "-np", "1", "--cache-ram", "0", "--no-webui"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.1)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": MAX_TOKENS, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True, "ignore_eos": True}
            req = urllib.request.Request(base + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                out.append(json.loads(r.read())["tokens"])
        return out
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    from ember.loader.default_model import cache_dir, fetch_default_model
    from ember.loader.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q5_0"])
    args = parser.parse_args()
    source = fetch_default_model()
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    files = {"Q4_1": source} | {q: quantized_file(source, q, cache_dir() / "models") for q in args.quantize}
    record = {"prompts": PROMPTS, "prompt_token_ids": prompts, "max_tokens": MAX_TOKENS, "files": {}}
    for name, path in files.items():
        record["files"][name] = {"file": path.name, "sha256": sha256(path), "tokens": greedy(path, prompts)}
        print(name, path, "done")
    DATA.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
