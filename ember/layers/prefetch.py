"""Which weights a decode step of a few rows warms in L2 before their matmul, and how much
(kernels/prefetch.py says why). Sites, in a Llama layer's order:

    qkv      this layer's q|k|v, issued after the previous layer's down (before the norm)
    o        o_proj, issued after q|k|v (before RoPE and attention)
    gate_up  gate|up, issued after o_proj (before the norm)
    down     down, issued after gate|up (before SiLU-and-mul)
    lm       the LM head, issued after the last layer

`EMBER_L2_PREFETCH="o=1,qkv=0.25"` sets fractions per site (none: off); `EMBER_L2_PREFETCH_HINT`
is "normal" or "last" (L2's eviction priority for the lines)."""

from __future__ import annotations

import os

import torch

SITES = ("qkv", "o", "gate_up", "down", "lm")
MAX_ROWS = 16  # beyond this a step is less bound by weight streaming


def parse_plan(spec: str) -> dict[str, float]:
    """"o=1,qkv=0.25" -> {"o": 1.0, "qkv": 0.25}."""
    plan = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        site, _, value = item.partition("=")
        if site not in SITES or not value:
            raise ValueError(f"EMBER_L2_PREFETCH items are SITE=FRACTION with SITE in {SITES}; got {item!r}")
        plan[site] = float(value)
    return plan


PLAN = parse_plan(os.environ.get("EMBER_L2_PREFETCH", ""))
HINT = os.environ.get("EMBER_L2_PREFETCH_HINT", "normal")


def prefetch(site: str, weight: torch.Tensor, x: torch.Tensor) -> None:
    """Warm PLAN[site] of `weight` in L2 when the step's activations x are a few rows on CUDA."""
    fraction = PLAN.get(site)
    if fraction and x.is_cuda and x.shape[0] <= MAX_ROWS:
        from ember.kernels.prefetch import prefetch_l2

        prefetch_l2(weight, fraction, HINT)
