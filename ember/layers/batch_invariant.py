"""Deterministic mode (EngineConfig.deterministic, --deterministic): every op gives a row the
same bits whatever else shares its step, so a request's output does not depend on batching,
chunked prefill, preemption or prefix-cache hits.

What varies with the batch, and what this mode does about it:
- CUDA linear layers: cuBLAS (and ember's GEMV at one row) choose kernels, split-K
  included, by the row count. Here every one runs kernels/matmul.py's invariant matmul.
- CUDA attention: flash-decoding splits a decode row's keys by the batch size, and decode
  and prefill rows take different kernels (a decoded token's K/V would differ from the
  same token recomputed after preemption). Here every row takes the prefill kernel, whose
  key tiles start at position 0 for every chunk.
- CPU dense layers (oneDNN, BLAS): their kernel follows the row count. Here they run on
  blocks of ROWS rows, the last padded (in_row_blocks).
Everything else is per row already: RMSNorm, RoPE, the activations, the embedding, sampling
(a seeded request draws from its own generator), W8A8 layers (layers/quant/w8a8.py: exact int32
sums, per-row scales) on any device, and on the CPU the GGUF block kernels and paged attention
(kernels/cpu), which is why the CPU's default path needs no flag.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.quant import WeightFormat
from ember.layers.quant.gguf_blocks import GGUFBlocks
from ember.layers.quant.w8a8 import W8A8Weight

# rows a dense CPU matmul takes at a time, padded with zeros: BLAS picks its kernel (and its
# order of arithmetic) by a call's row count, so fixed-size calls give a row fixed bits
ROWS = 16


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn on x's rows (x: [rows, features]) in calls of exactly ROWS rows, the last padded
    with zeros."""
    n = x.shape[0]
    pad = -n % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return torch.cat([fn(x[s:s + ROWS]) for s in range(0, n + pad, ROWS)])[:n]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, fmt: WeightFormat | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias (or fmt's matmul) with each row's bits independent of x's row count."""
    if isinstance(fmt, (GGUFBlocks, W8A8Weight)):  # per row by construction
        return fmt.apply(x, bias)
    if x.is_cuda and fmt is None:
        from ember.kernels.matmul import invariant_matmul  # triton is imported on CUDA only

        return invariant_matmul(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    fn = (lambda r: fmt.apply(r, bias)) if fmt is not None else (lambda r: F.linear(r, weight, bias))
    return in_row_blocks(fn, rows).view(*x.shape[:-1], -1)


def make_batch_invariant(model: nn.Module) -> None:
    """Switch a loaded model into deterministic mode: its linear layers, LM head and
    attention backend read `batch_invariant`."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
    for attn in model.attention_layers():
        attn.backend.batch_invariant = True
