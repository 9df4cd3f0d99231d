"""Rotary position embedding, rotate-half (NeoX / HF) layout: a head's first half pairs
with its second half. GGUF llama weights are un-permuted by the loader to this layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from ember.kernels import cpu as cpu_kernels
from ember.models.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        # [max_positions, head_dim]: cos | sin halves, looked up by position each step
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, head_dim] float32, cos | sin of these positions: once per forward, shared by
        every layer."""
        return self.cos_sin[positions]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; rope from `RotaryEmbedding.lookup`.
    On CUDA (one Triton kernel) and on the CPU (one C++ loop) q and k are rotated in place."""
    if q.is_cuda:
        from ember.kernels.rotary import rope_inplace

        rope_inplace(q, k, rope)
        return q, k
    if (ops := cpu_kernels.for_tensor(q)) is not None:
        ops.rotary_inplace(q, k, rope)
        return q, k
    cos, sin = rope.unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor, q_norm: nn.Module,
                    k_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q/k RMSNorm, then RoPE. On CUDA one Triton kernel does all three in
    place (the norms must share eps); elsewhere the norms, then `apply_rotary`."""
    if q.is_cuda and q_norm.eps == k_norm.eps:
        from ember.kernels.rotary import qk_norm_rope_inplace

        qk_norm_rope_inplace(q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope)
        return q, k
    return apply_rotary(q_norm(q), k_norm(k), rope)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
