"""HF checkpoints: one or several (sharded) .safetensors files in a directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no .safetensors file: ember loads HF checkpoints in safetensors format")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
