"""W8A8: int8 weights and int8 activations (compressed-tensors `int-quantized` checkpoints,
llm-compressor's W8A8 scheme; loader/int_checkpoint.py reads them):

    weight        int8 [N, K]           symmetric (no zero point)
    scale         float32 [N]           a scale per output channel (a per-tensor scale is that
                                        number on every row)
    input_scale   float32 [1] or None   a static per-tensor activation scale; None: dynamic,
                                        per token

    quantize_tokens(x)    per row m:  s[m] = max(max_k |x[m, k]|, AMAX_FLOOR) / 127,
                                      q[m, k] = round(x[m, k] / s[m])          in [-127, 127]
                          static:     s[m] = input_scale, q = round(x / s)     in [-128, 127]
    y = float32(q @ weight^T) * s[m] * scale[n] (+ bias[n]), in x's dtype

(round: half to even; x / s in float32, as IEEE divides.) The integer sum is exact in int32,
so a row's result does not depend on the other rows of its batch or on how a kernel tiles the
sum: W8A8 layers are batch invariant as they are (layers/batch_invariant.py needs nothing more).

    W8A8Tensor     one weight as the checkpoint holds it (narrow for tensor-parallel ranks,
                   stack_w8a8 for merged layers)
    W8A8Weight     the format a layer takes: apply(x, bias)

The paths, each these numbers (tests/layers/test_w8a8_weights.py holds them to the bit):

    CUDA   kernels/int8.py: the per-token quantization kernel, then the INT8 x INT8 -> int32
           tensor-core matmul with the scales and the bias in its epilogue, at every M
    CPU    quantize_tokens here, then torch._int_mm (oneDNN's int8 GEMM; 1.05-6.1x as fast as the
           float32 matmul on the dequantized weight at SmolLM2's and Llama-8B's shapes, M = 1 and
           64: benchmarks/BENCHMARKS.md), the epilogue in torch

Under tensor parallelism a row-parallel layer's rank quantizes its own columns of x (a scale per
token over those columns), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ember.layers.kernel_paths import cuda_paths
from ember.layers.quant import WeightFormat

QMAX = 127  # dynamic per-token activations map a row's largest magnitude here (vLLM's choice)
AMAX_FLOOR = 1e-12  # a row of zeros gets scale AMAX_FLOOR / 127, not 0


@dataclass(frozen=True)
class W8A8Tensor:
    """An int8 weight [N, K] with a float32 scale a row and the static input scale or None."""

    weight: torch.Tensor
    scale: torch.Tensor
    input_scale: torch.Tensor | None

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.int8 or self.weight.dim() != 2:
            raise ValueError(f"a W8A8 weight is int8 [N, K]; got {self.weight.dtype} {tuple(self.weight.shape)}")
        n = self.weight.shape[0]
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (n,):
            raise ValueError(f"the scales of a W8A8 weight of {n} rows are float32 [{n}]; got {self.scale.dtype} "
                             f"{tuple(self.scale.shape)}")
        if self.input_scale is not None and (self.input_scale.dtype != torch.float32
                                             or tuple(self.input_scale.shape) != (1,)):
            raise ValueError(f"a static input scale is float32 [1]; got {self.input_scale.dtype} "
                             f"{tuple(self.input_scale.shape)}")

    @staticmethod
    def from_checkpoint(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None
                        ) -> W8A8Tensor:
        """A checkpoint's int8 weight [N, K] with its weight_scale, one number (per tensor) or [N] /
        [N, 1] (per channel) in any float dtype, and input_scale (one number) where static."""
        n, k = weight.shape if weight.dim() == 2 else (-1, -1)
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"weight must be int8 [out, in]; got {weight.dtype} {list(weight.shape)}")
        if not weight_scale.is_floating_point() or weight_scale.numel() not in (1, n) \
                or weight_scale.dim() > 2 or (weight_scale.numel() == n > 1 and weight_scale.shape[0] != n):
            raise ValueError(f"weight_scale of an int8 weight [{n}, {k}] is one number (strategy tensor) or [{n}, 1] "
                             f"(strategy channel); got {weight_scale.dtype} {list(weight_scale.shape)}")
        scale = weight_scale.to(torch.float32).reshape(-1).expand(n).contiguous()
        if input_scale is not None:
            if not input_scale.is_floating_point() or input_scale.numel() != 1:
                raise ValueError(f"input_scale is one number (static per-tensor activations); got {input_scale.dtype} "
                                 f"{list(input_scale.shape)}")
            input_scale = input_scale.to(torch.float32).reshape(1)
            if not bool(input_scale > 0):
                raise ValueError(f"input_scale must be positive; got {input_scale.item()}")
        return W8A8Tensor(weight, scale, input_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def narrow(self, dim: int, start: int, length: int) -> W8A8Tensor:
        """Rows (dim 0) or input columns (dim 1) [start, start + length): a tensor-parallel rank's
        part (the scales are per row: columns keep them all)."""
        weight = self.weight.narrow(dim, start, length).contiguous()
        scale = self.scale.narrow(0, start, length).contiguous() if dim == 0 else self.scale
        return replace(self, weight=weight, scale=scale)

    def to(self, device: torch.device | str) -> W8A8Tensor:
        return W8A8Tensor(self.weight.to(device), self.scale.to(device),
                          None if self.input_scale is None else self.input_scale.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight q * scale in float32, rounded once to dtype (where no kernel takes W8A8:
        experts, an LM head; the activations then stay unquantized)."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)


def stack_w8a8(parts: list[W8A8Tensor]) -> W8A8Tensor | None:
    """The parts' rows one after another (q|k|v, gate|up), or None where their activations are
    quantized differently (dynamic beside static, or two static scales: the layer keeps them
    side by side, each quantizing x its own way)."""
    first = parts[0].input_scale
    same = all(p.input_scale is None for p in parts) if first is None else all(
        p.input_scale is not None and torch.equal(p.input_scale, first) for p in parts)
    if not same or len({p.shape[1] for p in parts}) != 1:
        return None
    return W8A8Tensor(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), first)


def quantize_w8a8(weight: torch.Tensor, input_scale: float | None = None) -> W8A8Tensor:
    """A float weight [N, K] in int8 with a scale per row (its largest magnitude to 127): what
    dummy weights become under a W8A8 checkpoint's config (benchmarks)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=AMAX_FLOOR) / QMAX
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    static = None if input_scale is None else torch.tensor([input_scale], dtype=torch.float32, device=w.device)
    return W8A8Tensor(q, scale, static)


def quantize_tokens(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], s float32 [M, 1]) as the module's doc says (kernels/int8.py's
    quantize_tokens computes the same bits on CUDA)."""
    x = x.float()
    if input_scale is None:
        s = x.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / QMAX
        return torch.round(x / s).clamp(-QMAX, QMAX).to(torch.int8), s
    s = input_scale.expand(x.shape[0], 1)
    return torch.round(x / s).clamp(-QMAX - 1, QMAX).to(torch.int8), s


class W8A8Weight(WeightFormat):
    """y = x @ W^T with x quantized to int8 per token (or by its static scale) and an int8 x int8
    matmul: the Triton kernels on CUDA (and where tests send CPU tensors down the CUDA paths,
    kernel_paths.gemv_on_cpu), torch._int_mm on the CPU."""

    def __init__(self, tensor: W8A8Tensor) -> None:
        self.weight = tensor.weight.contiguous()
        self.scale = tensor.scale.contiguous()
        self.input_scale = tensor.input_scale
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if cuda_paths(x):
            from ember.kernels.int8 import int8_matmul
            from ember.kernels.int8 import quantize_tokens as quantize_on_gpu  # triton only on the CUDA paths

            q, s = quantize_on_gpu(rows, self.input_scale, AMAX_FLOOR)
            y = int8_matmul(q, s, self.weight, self.scale, bias, x.dtype)
        else:
            q, s = quantize_tokens(rows, self.input_scale)
            y = torch._int_mm(q, self.weight.t()).float() * s * self.scale
            if bias is not None:
                y += bias.float()
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)
