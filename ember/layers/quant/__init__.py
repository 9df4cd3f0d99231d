"""Weight formats: how a linear layer's weight is held and multiplied, one file a format.

A layer (`Linear`, `MergedLinear`, `LMHead`) without a format multiplies its plain `weight`
parameter (F.linear; ember's GEMV on CUDA). A format replaces that parameter once the
weights are loaded and owns what it holds:

    unquantized.py   OneDNNPacked: a dense weight prepacked for oneDNN (CPU)
    gguf_blocks.py   GGUFBlocks: GGUF's block-quantized rows (Q4_0 ... Q6_K), int8 kernels (CPU)
    gguf_cuda.py     GGUFCudaBlocks: the same blocks on CUDA, dequantized in registers (Triton)
    fp8.py           FP8Weight: float8_e4m3fn with per-row or 128 x 128 block scales (CUDA
                     kernels; dequantized on the CPU)
    int_weight.py    IntWeight: 4- or 8-bit integers with group scales and zeros (W4A16, W8A16;
                     CUDA kernels; GGUF blocks on the CPU), read from AWQ (awq.py), GPTQ
                     (gptq.py) and compressed-tensors pack-quantized / weight-only
                     int-quantized (compressed_tensors.py)
    w8a8.py          W8A8Weight: int8 weights with a scale a row times int8 activations (per
                     token, or a static scale): compressed-tensors int-quantized W8A8 (CUDA
                     kernels; torch._int_mm on the CPU)
    split.py         Split: pieces of a merged layer in different formats, side by side

Model files never see formats: they call the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from ember.layers.kernel_paths import cuda_paths


class WeightFormat(ABC):
    """y = x @ W^T (+ bias) for a weight W of [out_features, in_features]."""

    out_features: int
    in_features: int

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features] in x's dtype."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weight the format holds."""



class KernelFormat(WeightFormat):
    """A format with CUDA kernels of its own (FP8, integer weights, GGUF blocks): a few rows
    through a weight-only GEMV (kernels/gemv.py; GGUF's in kernels/gguf.py), whose prologues
    layers/fused.py fuses in, more through `matmul`; off the CUDA paths F.linear on the weight
    dequantized to x's dtype, the reference."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out_features, in_features] in dtype."""

    @abstractmethod
    def uses_gemv(self, x: torch.Tensor) -> bool:
        """x [M, K] runs as the GEMV."""

    @abstractmethod
    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
        """The GEMV on x [M, K] (few rows) with kernels/gemv.py's prologue; returns what gemv
        returns ((y, h) for "norm")."""

    @abstractmethod
    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [M, K] (contiguous rows, M > 0) -> [M, out_features] through the format's matmul kernel."""

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not cuda_paths(x):
            return F.linear(x, self.dequantize(x.dtype), bias)
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        y = self.gemv(rows, bias) if self.uses_gemv(rows) else self.matmul(rows, bias)
        return y.view(*x.shape[:-1], self.out_features)


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight a model holds: its parameters off the meta device, and its formats'."""
    formats = {id(f): f for m in model.modules()
               for f in (getattr(m, "format", None), getattr(m, "blocks", None)) if isinstance(f, WeightFormat)}
    params = sum(p.nbytes for p in model.parameters() if p.device.type != "meta")
    return params + sum(f.nbytes for f in formats.values())
