"""A model directory for `ember serve` on the GPU: the Llama-3.1-8B shape (weights drawn with
--load-format dummy) with SmolLM2's tokenizer and chat template, so the server answers text
and chat through its real tokenizer path. The device has no hub and no GGUF reader, so this
runs here, on the default model's GGUF (transformers converts its tokenizer, as HF repos hold
it), and the directory is carried (h200.sh serve):

    python3 benchmarks/scripts/served_model.py .serve-model

The vocabulary is SmolLM2's 49,152 (the 8B's other shapes stay), so every id the model can
emit is one the tokenizer decodes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers

from ember.loader.default_model import fetch_default_model

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama-3.1-8b" / "config.json"


def write_served_model(out: Path) -> None:
    gguf = fetch_default_model()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config = json.loads(CONFIG.read_text())
    config.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    write_served_model(ap.parse_args().out)


if __name__ == "__main__":
    main()
