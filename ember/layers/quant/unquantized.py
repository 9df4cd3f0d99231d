"""A dense weight prepacked once into oneDNN's blocked layout: CPU matmuls then skip the
per-call reorder (1.5x in bfloat16, 2x in float32 at batch 16: benchmarks/BENCHMARKS.md)."""

from __future__ import annotations

import torch

from ember.layers.quant import WeightFormat


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN can prepack weights for this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDNNPacked(WeightFormat):
    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        self._nbytes = weight.nbytes

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self._nbytes
