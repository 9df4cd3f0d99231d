"""Gated activations in one pass, for gate_up = [gate | up] along the last dim:
SwiGLU silu(gate) * up, GeGLU (Gemma) gelu_tanh(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(y)) = x * sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3)
        y = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        out = gate / (1.0 + tl.exp(-2.0 * y)) * up
    else:
        out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(gate_up: torch.Tensor, gelu: bool, block: int) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [T, 2I] with contiguous rows; got {tuple(gate_up.shape)}")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _act_and_mul_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), I=inter,
                                                                 BLOCK=block, GELU=gelu)
    return out


def silu_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2I] with contiguous rows -> [T, I]."""
    return _act_and_mul(gate_up, False, block)


def gelu_tanh_and_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2I] with contiguous rows -> [T, I]."""
    return _act_and_mul(gate_up, True, block)
