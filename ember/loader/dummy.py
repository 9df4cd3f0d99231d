"""Seeded random weights at a config's real shapes (vLLM's load_format="dummy"), for
benchmarks and for tests that compare against HF on the same random weights. MXFP4 experts
(ModelConfig.mxfp4_experts, on CUDA) come as random uint8 blocks and scales."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ember.loader.weights import hf_weight_shapes
from ember.models.config import ModelConfig


def iter_dummy_weights(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """On the CPU: float32 draws from one CPU generator (the same weights on every machine).
    On CUDA the draws are made on the GPU in `dtype` (an 8B model in seconds, not minutes):
    other numbers than the CPU's for the same seed."""
    gen = torch.Generator(device=device).manual_seed(seed)
    draw_dtype = torch.float32 if device == "cpu" else dtype
    norm_center = 0.0 if cfg.norm_unit_offset else 1.0  # a Gemma norm scales by 1 + w
    for name, shape in hf_weight_shapes(cfg).items():
        if name.endswith("_blocks"):  # MXFP4 experts: random e2m1 codes
            yield name, torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
            continue
        if name.endswith("_scales"):  # 2^-8..2^-6: values of RMS ~0.02 (random codes' is 2.9), as the dense draws
            yield name, torch.randint(119, 122, shape, generator=gen, device=device, dtype=torch.uint8)
            continue
        t = torch.randn(shape, generator=gen, device=device, dtype=draw_dtype)
        if name.endswith("linear_attn.norm.weight"):  # Qwen3-Next's gated norm scales by w itself
            t = 1.0 + 0.1 * t
        elif name.lower().endswith("norm.weight"):  # an encoder's are LayerNorm.weight
            t = norm_center + 0.1 * t
        else:
            t = 0.02 * t
        yield name, t.to(dtype)
