"""The drafters of a speculative-decoding race, written once from the target's HF directory so
that every engine loads the same files (benchmarks/scripts/spec_gpu_race.py, h200.sh spec-race
models):

    INTO/draft_model   the target cut to its first N layers: the same embeddings, final norm,
                       lm_head and tokenizer files, config.json's num_hidden_layers N (its drafts are
                       the target's early guess, so some are kept and some are not; N = all of them:
                       the target itself, whose drafts are nearly all kept)
    INTO/eagle3        an EAGLE-3 head of random weights at the target's shapes (dummy_eagle3.py),
                       its aux layers the target's default (2, L/2, L-3) written into its config

    python -m ember.bench.spec_drafts TARGET_DIR INTO [--layers 4] [--draft-vocab 32000] [--seed 0]

A drafter already in INTO is kept (each is written to a temporary directory and renamed into place,
so a killed run leaves none half-written).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ember.bench.dummy_eagle3 import write_head_for

LAYER = "model.layers."
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def truncated_draft(target: Path, out: Path, layers: int) -> Path:
    """out/: the target's first `layers` decoder layers and every tensor outside them (embeddings,
    final norm, lm_head) in one model.safetensors, its config.json with num_hidden_layers (and any
    per-layer list) cut to `layers`, its other files (tokenizer, chat template) copied."""
    from safetensors.torch import save_file

    from ember.loader.safetensors import iter_safetensors

    config = json.loads((target / "config.json").read_text())
    total = config.get("num_hidden_layers")
    # every layer kept: the target as its own draft, whose drafts a greedy verify keeps nearly all of
    if not isinstance(layers, int) or not 1 <= layers <= (total or 0):
        raise ValueError(f"a truncated draft keeps 1 to {total} of the target's {total} layers; got {layers!r}")

    def keep(name: str) -> str | None:
        if name.startswith(LAYER):
            return name if int(name[len(LAYER):].split(".", 1)[0]) < layers else None
        return name

    tensors = {name: t.contiguous() for name, t in iter_safetensors(target, keep)}
    if not any(name.startswith(LAYER) for name in tensors):
        raise ValueError(f"{target} has no safetensors weights under {LAYER}N.* (HF's Llama layout); a truncated "
                         "draft is cut from such a checkpoint")
    config["num_hidden_layers"] = layers
    for key, value in list(config.items()):  # e.g. layer_types: one entry a layer
        if isinstance(value, list) and len(value) == total and key != "architectures":
            config[key] = value[:layers]
    out.mkdir(parents=True)
    for p in target.iterdir():
        if p.is_file() and p.name != "config.json" and p.name not in WEIGHT_NAMES \
                and not p.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(p, out / p.name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def eagle3_head(target: Path, out: Path, draft_vocab: int, seed: int) -> Path:
    """out/: a random EAGLE-3 head for the target (its aux layers the target's default, named)."""
    from ember.models.eagle3 import default_aux_layers

    config = json.loads((target / "config.json").read_text())
    return write_head_for(config, out, draft_vocab, seed, aux_layers=list(default_aux_layers(
        config["num_hidden_layers"])))


def _once(path: Path, write: Callable[[Path], Path]) -> Path:
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as tmp:
        write(Path(tmp) / "d")
        (Path(tmp) / "d").rename(path)
    return path


def write_drafts(target: str | Path, into: str | Path, layers: int = 4, draft_vocab: int = 32000,
                 seed: int = 0) -> dict[str, Path]:
    """{"draft_model": into/draft_model, "eagle3": into/eagle3}, each written unless already there."""
    target, into = Path(target), Path(into)
    if not (target / "config.json").is_file():
        raise ValueError(f"{target} has no config.json: the drafts are written from the target's HF directory")
    return {"draft_model": _once(into / "draft_model", lambda out: truncated_draft(target, out, layers)),
            "eagle3": _once(into / "eagle3", lambda out: eagle3_head(target, out, draft_vocab, seed))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="the target's HF directory (config.json, safetensors, tokenizer)")
    ap.add_argument("into", help="where draft_model/ and eagle3/ go")
    ap.add_argument("--layers", type=int, default=4, help="the truncated draft's layers (the target's first N)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="the EAGLE-3 head's draft vocabulary")
    ap.add_argument("--seed", type=int, default=0, help="the EAGLE-3 head's weights")
    args = ap.parse_args()
    for method, path in write_drafts(args.target, args.into, args.layers, args.draft_vocab, args.seed).items():
        print(f"{method}: {path}")


if __name__ == "__main__":
    main()
