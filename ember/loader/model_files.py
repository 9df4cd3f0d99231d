"""Where a model's weights, config and tokenizer come from, and loading them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ember.models.config import ModelConfig


@dataclass(frozen=True)
class ModelFiles:
    path: Path  # a .gguf file or an HF directory
    load_format: str  # gguf | safetensors | dummy

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    def model_config(self) -> ModelConfig:
        if self.is_gguf:
            f = self._gguf()
            return ModelConfig.from_gguf_metadata(f.metadata, f.tensor_names)
        return ModelConfig.from_hf_dir(self.path)

    def weights(self, cfg: ModelConfig, seed: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        if self.load_format == "dummy":
            from ember.loader.dummy import iter_dummy_weights

            if device == "cpu":
                return iter_dummy_weights(cfg, seed)
            return iter_dummy_weights(cfg, seed, dtype, device)
        if self.is_gguf:
            from ember.loader.gguf import iter_hf_weights

            return iter_hf_weights(self._gguf(), cfg)
        from ember.loader.safetensors import iter_safetensors

        return iter_safetensors(self.path)

    def _gguf(self):
        from ember.loader.gguf import open_gguf

        return open_gguf(self.path)


def locate_model(model: str | None, load_format: str) -> ModelFiles:
    """Check that `model` names something ember can load; None means the default model."""
    if model is None:
        from ember.loader.default_model import fetch_default_model

        path = fetch_default_model()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} not found: pass a .gguf file or an HF model directory "
            "(config.json + *.safetensors); ember cannot download from a model hub"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf: pass a .gguf file or an HF model directory")
        fmt = "gguf" if load_format == "auto" else load_format
        if fmt not in ("gguf", "dummy"):
            raise ValueError(f"load_format={load_format!r} does not fit a .gguf file: use 'auto' or 'gguf'")
    else:
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: an HF model directory needs config.json and *.safetensors")
        fmt = "safetensors" if load_format == "auto" else load_format
        if fmt not in ("safetensors", "dummy"):
            raise ValueError(f"load_format={load_format!r} does not fit an HF directory: use 'auto' or 'safetensors'")
    return ModelFiles(path, fmt)


def load_model(files: ModelFiles, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
               device: str, attention_backend: str, seed: int = 0) -> nn.Module:
    from ember.layers.attention import get_attention_backend
    from ember.loader.weights import load_weights
    from ember.models.registry import get_model_class

    model_class = get_model_class(cfg.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are made in the run dtype, on the device
    try:
        with torch.device(device):
            model = model_class(cfg, max_positions, get_attention_backend(attention_backend))
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, files.weights(cfg, seed, device, dtype), source=str(files.path))
    return model.eval()
