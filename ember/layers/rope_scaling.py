"""RopeScaling: how a model stretches its RoPE beyond the trained context (plain data, no torch:
the model config reads it from config.json or GGUF metadata, layers/rotary.py computes with it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE's frequencies are stretched beyond the trained context, by `kind`:

    linear    every frequency / factor
    dynamic   NTK: a larger base, chosen for the served context length (none within the trained one)
    yarn      interpolation blended into extrapolation between beta_slow and beta_fast rotations,
              cos/sin times attention_factor
    longrope  per-frequency factors: short ones within the trained context, long beyond it;
              cos/sin times attention_factor
    llama3    long wavelengths / factor, short ones kept, the band between blended
    freq_factors  every frequency / its own factor (llama.cpp's rope_freqs tensor: Llama 3's
              scaling, precomputed)
    """

    kind: str
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    attention_factor: float | None = None  # yarn, longrope; None: derived from factor
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()  # freq_factors
