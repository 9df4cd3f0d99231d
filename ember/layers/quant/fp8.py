"""FP8 weights: float8_e4m3fn values W [N, K] with float32 dequantization scales (W_real ~
W * scale), per output row [N] or per 128 x 128 block [ceil(N / 128), ceil(K / 128)]
(DeepSeek-V3 and Qwen3-FP8 checkpoints, `weight_block_size: [128, 128]`). A per-tensor
scale becomes per-row at load (the same number on every row).

    FP8Tensor       one weight as the checkpoint holds it (or as `quantize_weight` makes it
                    from a bf16/fp32 one, per output row); `stack_fp8` for merged layers
    FP8Weight       the format a layer holds: apply(x, bias)
    quantize_rows   the activations' dynamic quantization (per row, or per row and 128-group):
                    the plain-torch reference of kernels/fp8.py's kernel

FP8Weight.apply picks the matmul by shape, x as [M, K] (the lead measures the rule on the
H200: benchmarks/scripts/fp8_gemm_bench.py; layers/kernel_paths.py holds the row limit):

    M <= FP8_GEMV_MAX_ROWS (decode)   weight-only fp8 GEMV (kernels/gemv.py): x stays in its
                                      dtype, W is dequantized in registers; it takes the
                                      norm / SiLU before the layer (layers/fused.py)
    per-row scales, bf16 x, K and N   x quantized per row (kernels/fp8.py), then cuBLASLt:
    multiples of 16                   torch._scaled_mm(x_fp8, W^T, scale_a [M, 1], scale_b [1, N])
    otherwise (block scales, ...)     x quantized per row per 128 columns, kernels/fp8.py's
                                      Triton matmul (per-block scales inside the K loop)

On the CPU W is dequantized to x's dtype for an F.linear at each call: the plain reference
(ember dequantizes FP8 checkpoints once at load on the CPU unless quantization='fp8').
Every path allocates by shape alone and never syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.layers.kernel_paths import uses_fp8_gemv
from ember.layers.quant import KernelFormat

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
AMAX_FLOOR = 1e-12  # a row (group) of zeros gets scale AMAX_FLOOR / 448, not 0
BLOCK = 128  # block-scaled weights: 128 x 128; activations then get a scale per 128 columns


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x / scale rounded to e4m3 (nearest even, saturated), scale = max(amax, floor) / 448;
    amax broadcasts against x."""
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1] or [M, ceil(K / group)]):
    each row's (row group's) largest magnitude maps to 448. What kernels/fp8.py computes."""
    rows, k = x.shape
    x = x.float()
    if group is None:
        q, scale = _quantize(x, x.abs().amax(dim=1, keepdim=True))
        return q, scale
    groups = _cdiv(k, group)
    padded = F.pad(x, (0, groups * group - k)).view(rows, groups, group)
    q, scale = _quantize(padded, padded.abs().amax(dim=2, keepdim=True))
    return q.view(rows, groups * group)[:, :k].contiguous(), scale.view(rows, groups)


@dataclass(frozen=True)
class FP8Tensor:
    """weight float8_e4m3fn [N, K]; scale float32 [N] (per output row) or
    [ceil(N / 128), ceil(K / 128)] (per 128 x 128 block)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8 or self.weight.dim() != 2:
            raise ValueError(f"an FP8 weight is float8_e4m3fn [N, K]; got {self.weight.dtype} "
                             f"{tuple(self.weight.shape)}")
        n, k = self.weight.shape
        blocks = (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) not in ((n,), blocks):
            raise ValueError(f"the scales of an FP8 weight [{n}, {k}] are float32 [{n}] (per row) or {list(blocks)} "
                             f"(per {BLOCK} x {BLOCK} block); got {self.scale.dtype} {tuple(self.scale.shape)}")

    @staticmethod
    def from_checkpoint(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> FP8Tensor:
        """A checkpoint's weight and scale, told apart by the scale's shape: one number (per
        tensor: it becomes per row), [N] or [N, 1] (per row), or [ceil(N / 128),
        ceil(K / 128)] where the checkpoint says its blocks are 128 x 128 (`block`; a weight
        of one block has a [1, 1] scale, a block's, as its neighbours' are)."""
        n, k = weight.shape
        scale = scale.to(torch.float32)
        grid = (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
        if block is not None and tuple(block) == (BLOCK, BLOCK) and tuple(scale.shape) == grid:
            return FP8Tensor(weight, scale.contiguous())
        if scale.numel() == 1:
            return FP8Tensor(weight, scale.reshape(1).expand(n).contiguous())
        if tuple(scale.shape) in ((n,), (n, 1)):
            return FP8Tensor(weight, scale.reshape(n).contiguous())
        if scale.dim() == 2 and block is None:
            raise ValueError(f"a scale of {list(scale.shape)} for a weight [{n}, {k}] is a grid of blocks, but the "
                             "checkpoint's config names no weight block size")
        if scale.dim() == 2 and tuple(block) != (BLOCK, BLOCK):
            raise ValueError(f"FP8 weight blocks of {list(block)}: ember takes [{BLOCK}, {BLOCK}]")
        if tuple(scale.shape) != grid:
            raise ValueError(f"the scale of an FP8 weight [{n}, {k}] is one number (per tensor), [{n}] or [{n}, 1] "
                             f"(per row) or {list(grid)} (per {BLOCK} x {BLOCK} block); got {list(scale.shape)}")
        return FP8Tensor(weight, scale.contiguous())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def blockwise(self) -> bool:
        return self.scale.dim() == 2

    def narrow(self, dim: int, start: int, length: int) -> FP8Tensor:
        """Rows (dim 0) or columns (dim 1) [start, start + length), a tensor-parallel rank's
        part, with their scales; block scales need the cut on whole 128 x 128 blocks."""
        weight = self.weight.narrow(dim, start, length).contiguous()
        if not self.blockwise:
            return FP8Tensor(weight, self.scale.narrow(0, start, length).contiguous() if dim == 0 else self.scale)
        end = start + length
        if start % BLOCK or (end % BLOCK and end != self.weight.shape[dim]):
            raise ValueError(f"{'rows' if dim == 0 else 'columns'} [{start}, {end}) of an FP8 weight cut its "
                             f"{BLOCK} x {BLOCK} scale blocks: load the model with quantization='none' to split it "
                             "among tensor-parallel ranks")
        return FP8Tensor(weight, self.scale.narrow(dim, start // BLOCK, _cdiv(length, BLOCK)).contiguous())

    def pad_rows(self, rows: int) -> FP8Tensor:
        """Zero rows appended up to `rows` (their scales 1)."""
        n, k = self.weight.shape
        weight = torch.zeros(rows, k, dtype=FP8, device=self.weight.device)
        weight[:n] = self.weight
        scale = torch.ones((_cdiv(rows, BLOCK), self.scale.shape[1]) if self.blockwise else (rows,),
                           dtype=torch.float32, device=self.scale.device)
        scale[: self.scale.shape[0]] = self.scale
        return FP8Tensor(weight, scale)

    def to(self, device: torch.device | str) -> FP8Tensor:
        return FP8Tensor(self.weight.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W * scale in float32, then rounded once to dtype."""
        n, k = self.weight.shape
        if self.blockwise:
            scale = self.scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        else:
            scale = self.scale[:, None]
        return (self.weight.float() * scale).to(dtype)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, halves: int = 1,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stacked FP8 experts (kernels/moe.py's FP8Experts) W * scale in float32, rounded once to
    dtype: weight [E, N, K] with scales per row [E, N], or per 128 x 128 block of each of its
    `halves` (a gate|up weight's 2: each half's blocks its own) [E, halves * ceil(N / halves /
    128), ceil(K / 128)]."""
    e, n, k = weight.shape
    if scale.dim() == 2:
        full = scale[:, :, None]
    else:
        full = scale.unflatten(1, (halves, -1)).repeat_interleave(BLOCK, 2)[:, :, : n // halves].flatten(1, 2)
        full = full.repeat_interleave(BLOCK, 2)[:, :, :k]
    return (weight.float() * full).to(dtype)


def quantize_weight(weight: torch.Tensor) -> FP8Tensor:
    """A bf16/fp32 weight [N, K] in FP8 with a scale per output row (--quantization fp8)."""
    w = weight.detach().float()
    q, scale = _quantize(w, w.abs().amax(dim=1, keepdim=True))
    return FP8Tensor(q, scale.view(-1))


def stack_fp8(parts: list[FP8Tensor]) -> FP8Tensor | None:
    """The parts' rows one after another (q|k|v, gate|up): per-row scales side by side, or
    block scales where every part but the last fills whole 128-row blocks. None where they do
    not stack (mixed kinds, unaligned blocks): the layer keeps them side by side (Split)."""
    if len({p.shape[1] for p in parts}) != 1 or len({p.blockwise for p in parts}) != 1:
        return None
    if parts[0].blockwise and any(p.shape[0] % BLOCK for p in parts[:-1]):
        return None
    return FP8Tensor(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))


WIDE_ROWS = 16384  # from here on, one row goes to the fp8 matmul, not the GEMV (uses_gemv)


class FP8Weight(KernelFormat):
    def __init__(self, tensor: FP8Tensor) -> None:
        self.weight = tensor.weight.contiguous()
        self.scale = tensor.scale.contiguous()
        self.blockwise = tensor.blockwise
        self.out_features, self.in_features = self.weight.shape
        n, k = self.weight.shape
        # torch._scaled_mm's rowwise scaling: K and N multiples of 16, scale_b [1, N]
        self._scaled_mm_scale = None if self.blockwise or n % 16 or k % 16 else self.scale.view(1, n)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return FP8Tensor(self.weight, self.scale).dequantize(dtype)

    def uses_gemv(self, x: torch.Tensor) -> bool:
        """The fp8 GEMV for a few rows, but for the widest weights (Llama-8B's gate|up, 28672
        rows), where the Triton fp8 matmul read them faster at one row on the H200 (34 vs 46 us:
        benchmarks/BENCHMARKS.md)."""
        return uses_fp8_gemv(x) and self.out_features < WIDE_ROWS

    def gemv(self, x: torch.Tensor, bias: torch.Tensor | None = None, prologue: str = "none",
             residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6):
        """The weight-only fp8 GEMV on x [M, K] (few rows), with kernels/gemv.py's prologue;
        returns what gemv returns ((y, h) for "norm")."""
        from ember.kernels.gemv import gemv  # triton is imported only on the CUDA paths

        return gemv(x, self.weight, bias, prologue, residual, norm_weight, eps, weight_scale=self.scale)

    def matmul(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from ember.kernels.fp8 import fp8_matmul, quantize_groups

        few_rows = uses_fp8_gemv(rows)  # a wide weight's few rows: the Triton matmul (uses_gemv)
        if self._scaled_mm_scale is not None and rows.dtype == torch.bfloat16 and not few_rows:
            q, q_scale = quantize_groups(rows, None, AMAX_FLOOR)
            return torch._scaled_mm(q, self.weight.t(), scale_a=q_scale, scale_b=self._scaled_mm_scale, bias=bias,
                                    out_dtype=torch.bfloat16)
        q, q_scale = quantize_groups(rows, BLOCK if self.blockwise else None, AMAX_FLOOR)
        return fp8_matmul(q, q_scale, self.weight, self.scale, bias, rows.dtype)
