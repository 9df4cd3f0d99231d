"""Linear layers. A merged layer takes several checkpoint tensors, one per shard, through
the `weight_loader` its parameters carry; plain ones are copied whole by the loader. A layer
multiplies its `weight` parameter unless it has a weight format (layers/quant/): GGUF blocks
or FP8 weights the loader handed it (`load_blocks` / `load_fp8`, then `finish_loading`), its
own weight quantized to FP8 at load (`quantize_fp8`, --quantization fp8), or on the CPU the
dense weight prepacked once for oneDNN (`pack_for_cpu`). On CUDA, one row (a decode step of
one sequence) times a weight of a small model goes through ember's GEMV kernel
(kernels/gemv.py), which is faster than cuBLAS there and can take the op before it
(layers/fused.py); layers/kernel_paths.py says when, and `EMBER_SMALL_BATCH_GEMV=0` leaves
every size to cuBLAS."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.kernel_paths import gemv_on_cpu, uses_gemv  # noqa: F401 (tests take gemv_on_cpu from here)
from ember.layers.quant import WeightFormat
from ember.layers.quant.fp8 import FP8Tensor, FP8Weight, quantize_weight, stack_fp8
from ember.layers.quant.gguf_blocks import BlockTensor, GGUFBlocks, stack_rows
from ember.layers.quant.split import Dense, Split
from ember.layers.quant.unquantized import OneDNNPacked

Quantized = BlockTensor | FP8Tensor  # a weight the loader hands over in its checkpoint format


def _format(tensor: Quantized) -> WeightFormat:
    return GGUFBlocks(tensor) if isinstance(tensor, BlockTensor) else FP8Weight(tensor)


def _stack(parts: list[Quantized]) -> Quantized | None:
    """The shards' rows as one weight of one format, or None where they do not stack."""
    if all(isinstance(p, BlockTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
        return stack_rows(parts)
    if all(isinstance(p, FP8Tensor) for p in parts):
        return stack_fp8(parts)
    return None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.format: WeightFormat | None = None
        self._quantized: dict[int | None, Quantized] = {}  # shard (None: whole) -> its weight, until loaded

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
        self._keep(tensor, shard)

    def load_fp8(self, tensor: FP8Tensor, shard: int | None) -> None:
        """An FP8 checkpoint's weight (values and scales): the whole weight or one shard's rows."""
        self._keep(tensor.to(self.weight.device), shard)

    def _keep(self, tensor: Quantized, shard: int | None) -> None:
        rows = self.weight.shape[0] if shard is None else self.out_sizes[shard]
        if tuple(tensor.shape) != (rows, self.weight.shape[1]):
            raise ValueError(f"parameter rows {(rows, self.weight.shape[1])}, checkpoint {tuple(tensor.shape)}")
        self._quantized[shard] = tensor

    def finish_loading(self) -> None:
        """Once every checkpoint tensor is in: the quantized weights become the layer's
        format, one where the shards stack (GGUF blocks of one type, FP8 of one kind), else a
        Split of the shards side by side, dense ones among them."""
        quantized, self._quantized = self._quantized, {}
        if not quantized:
            return
        if None in quantized:
            return self.set_format(_format(quantized[None]))
        parts = [quantized.get(i) for i in range(len(self.out_sizes))]
        stacked = _stack(parts) if None not in parts else None
        if stacked is not None:
            return self.set_format(_format(stacked))
        dense = self.weight.data.split(self.out_sizes)
        self.set_format(Split([_format(p) if p is not None else Dense(d.clone()) for p, d in zip(parts, dense)]))

    def quantize_fp8(self) -> None:
        """The loaded dense weight in FP8 with a scale per output row (--quantization fp8)."""
        if self.format is None:
            self.set_format(FP8Weight(quantize_weight(self.weight)))

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
