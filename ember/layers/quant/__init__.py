"""Weight formats: how a linear layer's weight is held and multiplied, one file a format.

A layer (`Linear`, `MergedLinear`, `LMHead`) without a format multiplies its plain `weight`
parameter (F.linear; ember's GEMV on CUDA). A format replaces that parameter once the
weights are loaded and owns what it holds:

    unquantized.py   OneDNNPacked: a dense weight prepacked for oneDNN (CPU)
    gguf_blocks.py   GGUFBlocks: GGUF's block-quantized rows (Q4_0 ... Q6_K), int8 kernels (CPU)
    fp8.py           FP8Weight: float8_e4m3fn with per-row or 128 x 128 block scales (CUDA
                     kernels; dequantized on the CPU)
    split.py         Split: pieces of a merged layer in different formats, side by side

Model files never see formats: they call the layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weight a model holds: its parameters off the meta device, and its formats'."""
    formats = {id(f): f for m in model.modules()
               for f in (getattr(m, "format", None), getattr(m, "blocks", None)) if isinstance(f, WeightFormat)}
    params = sum(p.nbytes for p in model.parameters() if p.device.type != "meta")
    return params + sum(f.nbytes for f in formats.values())
