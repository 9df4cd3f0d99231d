"""A merged layer (q|k|v, gate|up) whose parts came in different formats, e.g. a Q4_K_M
file's q and k in Q4_K beside v in Q6_K: each part multiplies, outputs side by side. The
activations are quantized once for all the GGUF parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.layers.quant import WeightFormat
from ember.layers.quant.gguf_blocks import GGUFBlocks


class Dense(WeightFormat):
    """A plain weight as one part of a Split."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


class Split(WeightFormat):
    def __init__(self, parts: list[WeightFormat]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a merged layer take the same input")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        quantized = None
        outs = []
        for part in self.parts:
            if isinstance(part, GGUFBlocks):
                quantized = quantized or part.quantize(x)
                outs.append(part.apply_quantized(quantized, None, x.dtype).view(*x.shape[:-1], part.out_features))
            else:
                outs.append(part.apply(x))
        y = torch.cat(outs, dim=-1)
        return y if bias is None else y.add_(bias)
