"""Linear layers. A merged layer takes several checkpoint tensors, one per shard, through
the `weight_loader` its parameters carry; plain ones are copied whole by the loader. On the
CPU the weights can be prepacked once for oneDNN (`pack_for_cpu`). On CUDA, one row (a
decode step of one sequence) times a weight of a small model goes through ember's GEMV
kernel (kernels/gemv.py), which is faster than cuBLAS there and can take the op before it
(layers/fused.py); `EMBER_SMALL_BATCH_GEMV=0` leaves every size to cuBLAS."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


GEMV_MAX_WEIGHT = 1 << 24  # elements: Llama-8B's o_proj; its q|k|v, gate|up and down go to cuBLAS
_GEMV_ENABLED = os.environ.get("EMBER_SMALL_BATCH_GEMV", "1") != "0"
_GEMV_ON_CPU = False  # tests run the kernel on CPU tensors through Triton's interpreter


@contextlib.contextmanager
def gemv_on_cpu() -> Iterator[None]:
    """Take the GEMV path for CPU tensors too (Triton's interpreter): for tests."""
    global _GEMV_ON_CPU
    _GEMV_ON_CPU = True
    try:
        yield
    finally:
        _GEMV_ON_CPU = False


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear layer on x runs as ember's GEMV kernel: one row on CUDA, and a
    weight of at most 2^24 elements. There the kernel beat cuBLAS on the H200; at 2 to 4
    rows, and for bigger weights, cuBLAS is faster (benchmarks/BENCHMARKS.md, session 4)."""
    return ((x.is_cuda and _GEMV_ENABLED) or _GEMV_ON_CPU) and x.dim() == 2 and x.shape[0] == 1 \
        and weight.numel() <= GEMV_MAX_WEIGHT and x.dtype == weight.dtype and x.stride(1) == 1 \
        and weight.device == x.device


def cpu_packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN can prepack weights for this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered once into oneDNN's blocked layout: CPU matmuls then skip the
    per-call reorder (1.5x in bfloat16, 2x in float32 at batch 16: benchmarks/BENCHMARKS.md)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Keep only the packed weight; the parameter keeps its shape on the meta device."""
        self.packed = pack_weight(self.weight)
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if uses_gemv(x, self.weight):
            from ember.kernels.gemv import gemv  # triton is imported only on this path

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (q|k|v, gate|up).

    Output rows:  [ shard 0 | shard 1 | ... ]; checkpoint shard i fills rows
    offsets[i] : offsets[i] + sizes[i].
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.weight.weight_loader = self.load_shard
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard

    @property
    def num_shards(self) -> int:
        return len(self.out_sizes)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        rows = param.data.narrow(0, self.offsets[shard], self.out_sizes[shard])
        if rows.shape != loaded.shape:
            raise ValueError(
                f"shape mismatch for shard {shard}: parameter {tuple(rows.shape)}, checkpoint {tuple(loaded.shape)}"
            )
        rows.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.out_sizes, dim=-1)
