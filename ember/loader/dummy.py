"""Seeded random weights at a config's real shapes (vLLM's load_format="dummy"), for
benchmarks and for tests that compare against HF on the same random weights."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig


def iter_dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        yield name, t.to(dtype)
