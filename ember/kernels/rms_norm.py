"""RMSNorm over the last dim, optionally fused with the residual add before it:

    residual = x + residual        (rounded to the dtype, written back in place)
    y        = weight * (residual / rms(residual))   computed in float32, as layers/norm.py

x is [rows, N] or [T, heads, N] (Qwen3's per-head q/k norm on a strided view of qkv);
row r of a 3-D x is x[r // heads, r % heads].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, stride_xt, stride_xh, stride_yt, stride_yh, eps,
                     HEADS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    r = tl.program_id(0)
    t = r // HEADS
    h = r % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + t * N + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + t * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * (xf * inv).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + h * stride_yh + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Returns y shaped like x (contiguous); with `residual` ([rows, N] contiguous, 2-D x
    only) it is updated in place to x + residual first."""
    n = x.shape[-1]
    if x.stride(-1) != 1 or weight.shape != (n,) or x.dim() not in (2, 3):
        raise ValueError(f"x must be [rows, N] or [T, heads, N] with a contiguous last dim and weight [N]; "
                         f"got x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    if residual is not None and (x.dim() != 2 or residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous [rows, N] like x; got {tuple(residual.shape)}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.numel() // n
    if rows == 0:
        return y
    sx = (x.stride(0), x.stride(1) if x.dim() == 3 else 0)
    sy = (y.stride(0), y.stride(1) if y.dim() == 3 else 0)
    _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, y, *sx, *sy, eps,
                              HEADS=heads, N=n, BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None)
    return y
