"""Linear layers. A merged layer takes several checkpoint tensors, one per shard, through
the `weight_loader` its parameters carry; plain ones are copied whole by the loader. A layer
multiplies its `weight` parameter unless it has a weight format (layers/quant/): GGUF blocks
the loader handed it (`load_blocks`, then `finish_loading`), or on the CPU the dense weight
prepacked once for oneDNN (`pack_for_cpu`). On CUDA, one row (a
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

from ember.layers.quant import WeightFormat
from ember.layers.quant.gguf_blocks import BlockTensor, GGUFBlocks, stack_rows
from ember.layers.quant.split import Dense, Split
from ember.layers.quant.unquantized import OneDNNPacked


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


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.format: WeightFormat | None = None
        self._blocks: dict[int | None, BlockTensor] = {}  # shard (None: whole) -> GGUF blocks, until loaded

    def set_format(self, fmt: WeightFormat) -> None:
        """The format holds the weight from now on; the parameter keeps its shape and dtype on
        the meta device."""
        self.format = fmt
        self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)

    def pack_for_cpu(self) -> None:
        if self.format is None:
            self.set_format(OneDNNPacked(self.weight))

    def load_blocks(self, tensor: BlockTensor, shard: int | None) -> None:
        """A GGUF weight kept in its blocks: the whole weight (shard None) or one shard's rows."""
        rows = self.weight.shape[0] if shard is None else self.out_sizes[shard]
        if tensor.shape != (rows, self.weight.shape[1]):
            raise ValueError(f"parameter rows {(rows, self.weight.shape[1])}, checkpoint {tensor.shape}")
        self._blocks[shard] = tensor

    def finish_loading(self) -> None:
        """Once every checkpoint tensor is in: GGUF blocks become the layer's format, one
        GGUFBlocks where the shards share a type, else a Split beside the dense shards."""
        blocks, self._blocks = self._blocks, {}
        if not blocks:
            return
        if None in blocks:
            return self.set_format(GGUFBlocks(blocks[None]))
        parts = [blocks.get(i) for i in range(len(self.out_sizes))]
        if None not in parts and len({p.qtype for p in parts}) == 1:
            return self.set_format(GGUFBlocks(stack_rows(parts)))
        dense = self.weight.data.split(self.out_sizes)
        self.set_format(Split([GGUFBlocks(p) if p is not None else Dense(d.clone()) for p, d in zip(parts, dense)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format is not None:
            return self.format.apply(x, self.bias)
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
