"""Rotary position embedding, rotate-half (NeoX / HF) layout: a head's first half pairs
with its second half. GGUF llama weights are un-permuted by the loader to this layout.

Partial RoPE (Phi-4-mini: rotary_dim 96 of head_dim 128) turns only the first rotary_dim
dims of each head, pairing dim i with i + rotary_dim / 2 among them; the rest pass through:

    head   [ x1: rotary_dim/2 | x2: rotary_dim/2 | pass: head_dim - rotary_dim ]
    rope   [ cos: rotary_dim/2 | sin: rotary_dim/2 ]    (its width says the rotary_dim)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

from ember.kernels import cpu as cpu_kernels
from ember.layers.rope_scaling import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], the factor cos and sin are multiplied by) of a
    RoPE scaled as `scaling.kind` says (models/config.py). The two that depend on the context
    length (dynamic, longrope) are fixed by the served one, `max_positions`, as llama.cpp fixes
    them by its context: within the trained context they are the unscaled (dynamic) or
    short-factor (longrope) RoPE that transformers uses there."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq, 1.0
    original = scaling.original_max_position_embeddings
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "freq_factors":
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32), 1.0
    if scaling.kind == "dynamic":
        if max_positions <= original:
            return inv_freq, 1.0
        base = theta * (scaling.factor * max_positions / original - (scaling.factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return 1.0 / base**exponents, 1.0
    if scaling.kind == "longrope":
        factors = scaling.long_factor if max_positions > original else scaling.short_factor
        attention = scaling.attention_factor
        if attention is None:
            attention = 1.0 if scaling.factor <= 1 else math.sqrt(1 + math.log(scaling.factor) / math.log(original))
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents), float(attention)
    if scaling.kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, exponents)
    return _llama3(inv_freq, scaling), 1.0


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out)


def _yarn(rotary_dim: int, theta: float, scaling: RopeScaling, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than beta_slow times over the trained context are
    interpolated (/ factor), more than beta_fast times kept, a linear ramp between."""
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    def dim_of(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return rotary_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))

    attention = scaling.attention_factor
    if attention is None:
        attention = mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim) \
            if scaling.mscale and scaling.mscale_all_dim else mscale(scaling.factor)
    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    pos_freqs = theta**exponents
    inv_freq = (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 mrope_section: tuple[int, ...] | None = None, mrope_interleaved: bool = False) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(rotary_dim, theta, scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
        # [max_positions, rotary_dim]: cos | sin halves, looked up by position each step; YaRN and
        # LongRoPE scale both (and so every attention score) by attention_factor squared
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if attention_factor != 1.0:
            cos_sin = cos_sin * attention_factor
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        # M-RoPE: which of (t, h, w) turns each cos | sin column
        rows = None if mrope_section is None else mrope_rows(mrope_section, mrope_interleaved).repeat(2).view(1, 1, -1)
        self.register_buffer("mrope_rows", rows, persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim] float32, cos | sin of these positions: once per forward, shared by
        every layer. M-RoPE's positions [3, T] (t, h, w) take each frequency's angle from its
        section's row; 1-D positions are the rows of a step whose t, h and w are equal (text)."""
        if positions.dim() == 2:
            table = self.cos_sin[positions]  # [3, T, rotary_dim]
            return table.gather(0, self.mrope_rows.expand(1, table.shape[1], -1)).squeeze(0)
        return self.cos_sin[positions]


def mrope_rows(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which of M-RoPE's (t, h, w) turns each of the sum(section) frequencies: Qwen2-VL's
    sections in turn (t's, then h's, then w's), or Qwen3-VL's interleaved t h w t h w ...
    (h at i % 3 == 1 below 3 * section[1], w at i % 3 == 2 below 3 * section[2], t elsewhere)."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    i = torch.arange(sum(section))
    rows = torch.zeros_like(i)
    for axis in (1, 2):
        rows[(i % 3 == axis) & (i < 3 * section[axis])] = axis
    return rows


@dataclass(frozen=True)
class CacheWrite:
    """A layer's new V rows and the paged cache that k and v go into (see
    layers/attention/base.py): on CUDA the RoPE kernel stores them as it rotates k."""

    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def kernel_args(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor,
                 cache: CacheWrite | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; rope from `RotaryEmbedding.lookup`
    ([T, rotary_dim]: a narrower one turns the first rotary_dim dims of each head alone).
    On CUDA (one Triton kernel) and on the CPU (one C++ loop) q and k are rotated in place.
    Returns (q, k, whether k and v are in `cache` now: on CUDA the same kernel writes them, on
    the CPU the same loop, converting to a float cache's dtype (fp8: not there))."""
    if q.is_cuda:
        from ember.kernels.rotary import rope_inplace

        rope_inplace(q, k, rope, **(cache.kernel_args() if cache is not None else {}))
        return q, k, cache is not None
    if (ops := cpu_kernels.for_tensor(q)) is not None:
        if cache is not None and cache.k_cache is not None and cache.k_cache.dtype in cpu_kernels.DTYPES \
                and cache.slot_mapping.dtype == torch.int64:  # a float cache (not fp8): stored as it turns
            ops.rotary_inplace(q, k, rope, cache.v, cache.k_cache, cache.v_cache, cache.slot_mapping)
            return q, k, True
        ops.rotary_inplace(q, k, rope)
        return q, k, False
    cos, sin = rope.unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), False


def norm_and_rotate(q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
                    cache: CacheWrite | None = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Qwen3's per-head q/k RMSNorm, then RoPE. On CUDA one Triton kernel does all three in
    place (the norms must share eps), and writes the cache as `apply_rotary` does; elsewhere
    the norms, then `apply_rotary`."""
    if q.is_cuda and q_norm.eps == k_norm.eps:
        from ember.kernels.rotary import qk_norm_rope_inplace

        qk_norm_rope_inplace(q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope,
                             **(cache.kernel_args() if cache is not None else {}))
        return q, k, cache is not None
    return apply_rotary(q_norm(q), k_norm(k), rope, cache)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), x[..., 2 * half:]], dim=-1)
