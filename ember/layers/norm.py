import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import cpu as cpu_kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in float32 like the reference implementations.

    With `residual`, the residual add before the norm is fused in: returns
    (norm(x + residual), x + residual). On CUDA one Triton kernel does both, on the CPU
    one C++ kernel (ember/kernels/cpu); both update `residual` in place.

    `unit_offset` (Gemma): the checkpoint holds w and the norm scales by (1 + w); the 1 is
    added once, as the weight loads, so every kernel runs the plain norm. `weightless` (Llama
    4's q/k L2 norm): a weight of ones that no checkpoint holds."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False, weightless: bool = False) -> None:
        super().__init__()
        self.eps = eps
        if weightless:
            self.register_buffer("weight", torch.ones(size), persistent=False)
        else:
            self.weight = nn.Parameter(torch.ones(size))
        if unit_offset:
            self.weight.weight_loader = _load_plus_one


    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            from ember.kernels.rms_norm import rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps, residual), residual  # residual updated in place
        if (ops := cpu_kernels.for_tensor(x)) is not None and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps) if residual is None else \
                (ops.rms_norm(x, self.weight, self.eps, residual), residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _load_plus_one(param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded.float() + 1.0)  # in float32, as Gemma's norm adds it


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias (GPT-2, OPT, Phi-2), in float32;
    with `residual`, (norm(x + residual), x + residual) as RMSNorm gives them."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
