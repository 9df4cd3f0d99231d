"""GGUF block-quantized weights on CUDA, kept quantized: the file's bytes split at load into
planes the Triton kernels read (kernels/gguf.py draws them), each value dequantized in
registers as ggml decodes it. The CPU keeps GGUFBlocks (gguf_blocks.py) and its int8 kernels.

    GGUFPlanes       one weight's planes (from a BlockTensor: q|k|v stacked, a rank's part
                     narrowed before)
    GGUFCudaBlocks   the format a layer holds: a few rows through the GEMV (weight read once,
                     float32 arithmetic, the norm / SiLU before the layer fused in:
                     layers/fused.py), more through the tensor-core matmul; rows(ids) for an
                     embedding table (a tied LM head multiplies the same planes)
    gguf_format      the format a layer takes: GGUFCudaBlocks on the CUDA paths, else GGUFBlocks

Bytes a weight are the file's but for the K-quants' 6-bit sub-block scales and minimums,
unpacked to a byte each (Q4_K 148 bytes a 256 values for the file's 144, Q5_K 180 for 176).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ember.layers.kernel_paths import cuda_paths, uses_gguf_gemv
from ember.layers.quant import KernelFormat
from ember.layers.quant.gguf_blocks import KERNEL_TYPES, BlockTensor, GGUFBlocks


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of a super-block [..., 12] -> (sc, mn) uint8 [..., 8], 6 bits each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (minimums); 4-7 in the
    nibbles of bytes 8-11, their top two bits in the top two of bytes 0-3 and 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc, mn


@dataclass(frozen=True)
class GGUFPlanes:
    """A weight [rows, cols] of GGML type `qtype` as the CUDA kernels read it."""

    qtype: int
    shape: tuple[int, int]
    qs: torch.Tensor  # the values' low bits (Q8_0: int8 values)
    qh: torch.Tensor | None  # high bits: Q5_0 / Q5_1 int32 a block, Q5_K / Q6_K bytes
    d: torch.Tensor  # float16 scale a block (K-quants: a super-block)
    m: torch.Tensor | None  # float16 minimum (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
    sc: torch.Tensor | None  # sub-block scales: uint8 (Q4_K, Q5_K: 6 bits) or int8 (Q6_K)
    mn: torch.Tensor | None  # sub-block minimums, uint8 (Q4_K, Q5_K)

    @staticmethod
    def from_blocks(tensor: BlockTensor) -> GGUFPlanes:
        """The BlockTensor's bytes split into planes on its device (layouts: kernels/gguf.py)."""
        _, values, nbytes = KERNEL_TYPES[tensor.qtype]
        n, k = tensor.shape
        blocks = tensor.data.view(n, k // values, nbytes)

        def part(start: int, end: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            return blocks[..., start:end].contiguous().view(dtype).reshape(n, -1)

        qt, f16 = tensor.qtype, torch.float16
        qh = m = sc = mn = None
        if qt == 2:  # Q4_0: d, qs[16]
            d, qs = part(0, 2, f16), part(2, 18)
        elif qt == 3:  # Q4_1: d, m, qs[16]
            d, m, qs = part(0, 2, f16), part(2, 4, f16), part(4, 20)
        elif qt == 6:  # Q5_0: d, qh u32, qs[16]
            d, qh, qs = part(0, 2, f16), part(2, 6, torch.int32), part(6, 22)
        elif qt == 7:  # Q5_1: d, m, qh u32, qs[16]
            d, m, qh, qs = part(0, 2, f16), part(2, 4, f16), part(4, 8, torch.int32), part(8, 24)
        elif qt == 8:  # Q8_0: d, qs[32] int8
            d, qs = part(0, 2, f16), part(2, 34, torch.int8)
        elif qt in (12, 13):  # Q4_K: d, dmin, scales[12], qs[128]; Q5_K: ..., qh[32], qs[128]
            d, m = part(0, 2, f16), part(2, 4, f16)
            sc, mn = (t.reshape(n, -1) for t in _k_scales(blocks[..., 4:16]))
            qh, qs = (part(16, 48), part(48, 176)) if qt == 13 else (None, part(16, 144))
        else:  # Q6_K: ql[128], qh[64], scales[16] int8, d
            qs, qh, sc, d = part(0, 128), part(128, 192), part(192, 208, torch.int8), part(208, 210, f16)
        return GGUFPlanes(qt, (n, k), qs, qh, d, m, sc, mn)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.qh, self.d, self.m, self.sc, self.mn) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def kernel_args(self) -> tuple:
        """The planes in kernels/gguf.py's order (qs, qh, d, m, sc, mn)."""
        return tuple(getattr(self, f.name) for f in fields(self)[2:])


class GGUFCudaBlocks(KernelFormat):
    """x @ W^T with W's GGUF blocks dequantized in registers (kernels/gguf.py); off the CUDA
    paths, F.linear on the weight dequantized by the rows kernel (Triton's interpreter on the
    CPU)."""

    def __init__(self, tensor: BlockTensor) -> None:
        self.planes = GGUFPlanes.from_blocks(tensor)
        self.qtype = tensor.qtype
        self.type_name = tensor.type_name
        self.out_features, self.in_features = tensor.shape

    @property
    def nbytes(self) -> int:
        return self.planes.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=self.planes.qs.device), dtype)

    def uses_gemv(self, x: torch.Tensor) -> bool:
        return uses_gguf_gemv(x)

    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
        from ember.kernels.gguf import gguf_gemv  # triton is imported only on the CUDA paths

        return gguf_gemv(x, self.qtype, self.planes.kernel_args(), self.out_features, bias, prologue, residual,
                         norm_weight, eps)

    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from ember.kernels.gguf import gguf_matmul

        return gguf_matmul(rows, self.qtype, self.planes.kernel_args(), self.out_features, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized to dtype (an embedding lookup): the file's float32 values rounded once."""
        from ember.kernels.gguf import gguf_rows

        return gguf_rows(ids, self.qtype, self.planes.kernel_args(), self.out_features, self.in_features, dtype)


def gguf_format(tensor: BlockTensor) -> GGUFCudaBlocks | GGUFBlocks:
    """The format a layer holding these blocks takes: the CUDA kernels' where the blocks are on
    CUDA (or tests send CPU tensors down the CUDA paths, kernel_paths.gemv_on_cpu), else the
    CPU kernels'."""
    return GGUFCudaBlocks(tensor) if cuda_paths(tensor.data) else GGUFBlocks(tensor)

