"""GGUF's block-quantized weights, kept as the file stores them and multiplied by the CPU
kernels (kernels/cpu/quant_gemm.cpp): the activations are quantized to int8 per block of 32
on the fly and the dot products are integer, block by block, as llama.cpp's CPU path does.
On CUDA the same blocks take gguf_cuda.py's format instead.

    BlockTensor   one weight's rows of blocks as read from the file (what the loader yields)
    GGUFBlocks    the format a layer holds on the CPU, the rows repacked for the kernels:
                  apply(x), and rows(ids) for an embedding table
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.layers.quant import WeightFormat
from ember.layers.quant.ggml import dequantize

# ggml type id -> (name, values per block, bytes per block): the types the kernels multiply
KERNEL_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}


@dataclass(frozen=True)
class BlockTensor:
    """A 2-D weight in one of KERNEL_TYPES: each of `shape[0]` rows is shape[1] values in
    blocks, `data` is uint8 [rows, row bytes]. Rows can be reordered or stacked as bytes."""

    qtype: int
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        name, values, nbytes = KERNEL_TYPES[self.qtype]
        rows, cols = self.shape
        if cols % values or tuple(self.data.shape) != (rows, cols // values * nbytes) or self.data.dtype != torch.uint8:
            raise ValueError(f"{name} rows of {cols} values need uint8 [{rows}, {cols // values * nbytes}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.qtype][0]

    def narrow(self, dim: int, start: int, length: int) -> BlockTensor:
        """Rows [start, start + length) (dim 0), or those columns of every row (dim 1), which
        must fall on block boundaries: a tensor-parallel rank's part."""
        if dim == 0:
            return BlockTensor(self.qtype, (length, self.shape[1]), self.data.narrow(0, start, length))
        name, values, nbytes = KERNEL_TYPES[self.qtype]
        if start % values or length % values:
            raise ValueError(f"columns [{start}, {start + length}) of a {name} weight cut its blocks of {values}: "
                             "load the model with quantization='none' to split it among tensor-parallel ranks")
        return BlockTensor(self.qtype, (self.shape[0], length),
                           self.data.narrow(1, start // values * nbytes, length // values * nbytes).contiguous())

    def pad_rows(self, rows: int) -> BlockTensor:
        """Zero rows appended up to `rows` (zero blocks decode to zeros in every type)."""
        data = torch.zeros(rows, self.data.shape[1], dtype=torch.uint8, device=self.data.device)
        data[: self.shape[0]] = self.data
        return BlockTensor(self.qtype, (rows, self.shape[1]), data)

    def to(self, device: torch.device | str) -> BlockTensor:
        return BlockTensor(self.qtype, self.shape, self.data.to(device))

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 (on the CPU), as ggml decodes it."""
        return dequantize(self.data.cpu().numpy(), self.qtype, self.shape)


def stack_rows(parts: list[BlockTensor]) -> BlockTensor:
    """The parts' rows one after another (q|k|v, gate|up); all of one type and width."""
    if len({(p.qtype, p.shape[1]) for p in parts}) != 1:
        raise ValueError("only rows of one type and width stack")
    return BlockTensor(parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                       torch.cat([p.data for p in parts]))


# int8 values, scales d, d * sum per block of 32, and per 16 (kernels/cpu/quant.h)
Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class GGUFBlocks(WeightFormat):
    """A weight's rows repacked at load into the kernels' tiles of 16 rows (the file's bytes
    reordered: kernels/cpu/quant.h draws the layout); the file's order is not kept."""

    def __init__(self, tensor: BlockTensor) -> None:
        from ember.kernels.cpu import ops

        self.ops = ops()
        if self.ops is None:
            raise ValueError("GGUF blocks need ember's CPU kernels, which did not build: load the model "
                             "dequantized (quantization='none')")
        self.qtype = tensor.qtype
        self.type_name = tensor.type_name
        self.out_features, self.in_features = tensor.shape
        self.packed = self.ops.quant_repack(tensor.data, tensor.qtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def quantize(self, x: torch.Tensor) -> Quantized:
        rows = x.reshape(-1, self.in_features)
        return self.ops.quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous())

    def apply_quantized(self, q: Quantized, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return self.ops.quant_matmul(*q, self.packed, self.qtype, self.out_features, bias, dtype)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
              norm_weight: torch.Tensor | None = None, eps: float = 0.0,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on x, or with a prologue fused in (one kernel call): on prologue(x), where
        "norm" is RMSNorm(x + residual) with `norm_weight` (residual updated in place, as
        layers/norm.py does), "silu" / "gelu_tanh" the gated activation of x = [gate | up]."""
        rows = x.reshape(-1, x.shape[-1])
        y = self.ops.quant_linear(rows if rows.stride(-1) == 1 else rows.contiguous(), self.packed, self.qtype,
                                  self.out_features, bias, prologue, norm_weight, eps, residual)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup): the file's float32 values, exactly."""
        flat = ids.reshape(-1).to(torch.int64)
        values = self.ops.quant_rows(self.packed, self.qtype, self.out_features, self.in_features, flat)
        return values.to(dtype).view(*ids.shape, self.in_features)
