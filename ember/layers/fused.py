"""The op before a linear layer fused into it where the layer runs as ember's GEMV kernel
(one row on CUDA: a decode step of one sequence, where a layer's time is mostly kernel
launches; see layers/kernel_paths.py; FP8 and integer weights and GGUF blocks at a few rows
take their GEMVs too) or on GGUF blocks on the CPU (integer weights mapped to blocks too; their kernel
quantizes its input anyway, and a step's time is mostly calls):
RMSNorm with the residual add into q|k|v and gate|up, the gated activation into down. One
kernel each instead of two (kernels/gemv.py, kernels/cpu/quant_gemm.cpp); elsewhere the two
ops as they are. A row-parallel layer (down) adds its bias after the all-reduce, so the
kernels take its `fused_bias` and their output goes through its `reduce_output`."""

from __future__ import annotations

import torch

from ember.layers.activation import gelu_tanh_and_mul, silu_and_mul
from ember.layers.linear import Linear
from ember.layers.norm import LayerNorm, RMSNorm
from ember.layers.quant import KernelFormat
from ember.layers.quant.gguf_blocks import GGUFBlocks


def norm_linear(norm: RMSNorm | LayerNorm, layer: Linear, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(norm(x + residual)), x + residual); residual None (the first layer): x alone.
    The fused kernel returns the sum as a new tensor, the unfused norm updates `residual`.
    The kernels fuse an RMSNorm; a LayerNorm runs on its own."""
    if isinstance(norm, LayerNorm):
        return _unfused(norm, layer, x, residual)
    if layer.takes_gemv(x) and norm.weight.dtype == x.dtype:
        from ember.kernels.gemv import gemv

        return gemv(x, layer.weight, layer.bias, "norm", residual, norm.weight, norm.eps)
    if _format_gemv(layer, x) and norm.weight.dtype == x.dtype:
        return layer.format.gemv(x, layer.bias, "norm", residual, norm.weight, norm.eps)
    if isinstance(layer.format, GGUFBlocks) and norm.weight.dtype == x.dtype:
        if residual is None:
            return layer.format.apply(x, layer.bias, "norm", norm.weight, norm.eps), x
        return layer.format.apply(x, layer.bias, "norm", norm.weight, norm.eps, residual), residual
    return _unfused(norm, layer, x, residual)


def _format_gemv(layer: Linear, x: torch.Tensor) -> bool:
    """The layer's format has a GEMV (FP8, integer weights, GGUF blocks on CUDA) and x takes it; never
    in deterministic mode, whose matmuls take fixed blocks of rows (layers/batch_invariant.py)."""
    return isinstance(layer.format, KernelFormat) and not layer.batch_invariant and layer.format.uses_gemv(x)


def add_norm(norm: RMSNorm | LayerNorm, x: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual); residual None (the first layer): (norm(x), x)."""
    return (norm(x), x) if residual is None else norm(x, residual)


def _unfused(norm: RMSNorm | LayerNorm, layer: Linear, x: torch.Tensor,
             residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    h, residual = add_norm(norm, x, residual)
    return layer(h), residual


def silu_linear(layer: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """layer(silu(gate) * up) for gate_up = [gate | up]."""
    if layer.takes_gemv(gate_up):
        from ember.kernels.gemv import gemv

        return layer.reduce_output(gemv(gate_up, layer.weight, layer.fused_bias, "silu"))
    if _format_gemv(layer, gate_up):
        return layer.reduce_output(layer.format.gemv(gate_up, layer.fused_bias, "silu"))
    if isinstance(layer.format, GGUFBlocks):
        return layer.reduce_output(layer.format.apply(gate_up, layer.fused_bias, "silu"))
    return layer(silu_and_mul(gate_up))


def gelu_linear(layer: Linear, gate_up: torch.Tensor) -> torch.Tensor:
    """layer(gelu_tanh(gate) * up) for gate_up = [gate | up] (Gemma)."""
    if isinstance(layer.format, GGUFBlocks):
        return layer.reduce_output(layer.format.apply(gate_up, layer.fused_bias, "gelu_tanh"))
    return layer(gelu_tanh_and_mul(gate_up))
