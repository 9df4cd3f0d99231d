"""Writes data/llama_cpp_greedy.json: llama.cpp's own greedy continuations of PROMPTS on the
default model (SmolLM2-135M-Instruct Q4_1) and on its K-quant conversions, the reference
tests/models/test_quantized_vs_llama_cpp.py compares ember's quantized path with, so that
CI checks it without a llama.cpp build. Run it where the peer is built:

    python tests/models/llama_cpp_reference.py [--quantize Q4_K_M Q6_K ...]

It runs llama.cpp's llama-server on each file (tests/llama_cpp_tools.py), sends the prompts as
token ids and records the tokens (with llama.cpp's ignore_eos: 64 each)."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
from llama_cpp_tools import greedy, tool  # noqa: E402

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
        subprocess.run([str(tool("llama-quantize", "EMBER_LLAMA_QUANTIZE")), "--allow-requantize", str(source), str(out),
                        qtype, "2"],
                       check=True, capture_output=True)
    return out


def main() -> None:
    from ember.loader.default_model import cache_dir, fetch_default_model
    from ember.loader.tokenizer_files import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantize", nargs="*", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q5_0"])
    args = parser.parse_args()
    source = fetch_default_model()
    tokenizer = load_tokenizer(source)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    files = {"Q4_1": source} | {q: quantized_file(source, q, cache_dir() / "models") for q in args.quantize}
    record = {"prompts": PROMPTS, "prompt_token_ids": prompts, "max_tokens": MAX_TOKENS, "files": {}}
    server = tool("llama-server", "EMBER_LLAMA_SERVER")
    with tempfile.TemporaryDirectory() as logs:
        for name, path in files.items():
            tokens = greedy(server, path, prompts, MAX_TOKENS, 1024, Path(logs), ignore_eos=True).tokens
            record["files"][name] = {"file": path.name, "sha256": sha256(path), "tokens": tokens}
            print(name, path, "done")
    DATA.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
