"""HF checkpoints in a directory: .safetensors files (one, or the shards that
model.safetensors.index.json names), or failing that pytorch_model*.bin files."""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
PT_PATTERN = "pytorch_model*.bin"


def checkpoint_format(model_dir: str | Path) -> str:
    """'pt' for a directory whose weights are pytorch_model*.bin alone, else 'safetensors'."""
    d = Path(model_dir)
    has_safetensors = (d / SAFETENSORS_INDEX).is_file() or any(d.glob("*.safetensors"))
    has_pt = (d / PT_INDEX).is_file() or any(d.glob(PT_PATTERN))
    return "pt" if has_pt and not has_safetensors else "safetensors"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The shards the index names where there is one (so a consolidated.safetensors beside
    them is not read twice), else every .safetensors file."""
    d = Path(model_dir)
    files = _indexed_files(d / SAFETENSORS_INDEX) if (d / SAFETENSORS_INDEX).is_file() else \
        sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors file: ember loads HF checkpoints in safetensors format "
                         "(or pytorch_model*.bin)")
    return files


def pt_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    files = _indexed_files(d / PT_INDEX) if (d / PT_INDEX).is_file() else sorted(d.glob(PT_PATTERN))
    if not files:
        raise ValueError(f"{model_dir} holds no pytorch_model*.bin file: pass an HF checkpoint directory")
    return files


# a checkpoint tensor's name -> the name it is loaded under, or None: not read (loader/weights.py)
Rename = Callable[[str], str | None]


def iter_safetensors(model_dir: str | Path, rename: Rename | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, or with `rename` those it keeps, under their new names:
    a tensor it drops is never read from the file (only the header names it)."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = name if rename is None else rename(name)
                if target is not None:
                    yield target, f.get_tensor(name)


def iter_pt(model_dir: str | Path, rename: Rename | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """pytorch_model*.bin files, memory-mapped; tensors only (weights_only: no pickled code runs).
    `rename` as for iter_safetensors: a dropped tensor's pages are not touched."""
    files = pt_files(model_dir)
    logger.warning("%s: loading pytorch_model*.bin files; safetensors is preferred (faster to load, "
                   "and no pickle)", model_dir)
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            raise ValueError(f"{file} holds more than tensors{f' ({found[1]})' if found else ''}, and ember loads "
                             ".bin files with weights_only=True (no pickled object is made): convert the checkpoint "
                             "to safetensors") from None
        except Exception as e:  # torch raises several types for a bad or legacy-format file
            raise ValueError(f"{file} cannot be loaded as a PyTorch checkpoint of tensors ({type(e).__name__}: "
                             f"{str(e)[:300]}): convert the checkpoint to safetensors") from None
        if not isinstance(state, dict):
            raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{file}: {name!r} is a {type(tensor).__name__}, not a tensor")
            target = name if rename is None else rename(name)
            if target is not None:
                yield target, tensor


def tensor_names(model_dir: str | Path, load_format: str = "safetensors") -> list[str]:
    """The names of a checkpoint's tensors, from its safetensors index or files' headers (or its
    .bin files, memory-mapped), reading no tensor."""
    d = Path(model_dir)
    if load_format == "pt":
        try:
            return [name for file in pt_files(d) for name in torch.load(file, map_location="cpu", weights_only=True,
                                                                        mmap=True)]
        except Exception:  # a file iter_pt refuses, with the reason, when the weights are read
            return []
    if (d / SAFETENSORS_INDEX).is_file():
        _indexed_files(d / SAFETENSORS_INDEX)  # the index is readable and its shards are there
        return list(json.loads((d / SAFETENSORS_INDEX).read_text(encoding="utf-8"))["weight_map"])
    from safetensors import safe_open

    names: list[str] = []
    for file in safetensors_files(d):
        with safe_open(str(file), framework="pt") as f:
            names += f.keys()
    return names


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{index} is not a readable index ({e}): download it again") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map: download it again")
    files = [index.parent / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index} names {', '.join(missing)}, missing from {index.parent}: download the "
                         "missing shard(s) again")
    return files
