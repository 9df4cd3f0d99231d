"""Rotary embedding (rotate-half layout) applied in place to q and k, one program per token.

    cos_sin  [T, D]: cos | sin of each token's position (D/2 each), looked up once per forward
    x        [T, heads, D]: x[..., :D/2] and x[..., D/2:] are a head's pairs
    out1 = x1 cos - x2 sin,  out2 = x2 cos + x1 sin   (float32, rounded to x's dtype)

`qk_norm_rope_inplace` first applies Qwen3's per-head RMSNorm to each head of q and k, in
the same program (one kernel where norm + norm + rope took three): the normalized head is
rounded to x's dtype as layers/norm.py rounds it, then rotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, w_ptr, t, stride_t, stride_h, cos, sin, eps, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
            HALF: tl.constexpr, NORM: tl.constexpr):
    """Rotate token t's heads in place; with NORM, RMSNorm each head (weight w_ptr) first."""
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, HALF)
    mask = (h < HEADS)[:, None]
    p1 = x_ptr + t * stride_t + h[:, None] * stride_h + c[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # rounded to x's dtype as RMSNorm's output is, then rotated
        inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + c).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + c).to(tl.float32)[None, :]
        a = (w1 * (a * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cs_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 QH: tl.constexpr, KH: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                 HALF: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + t * 2 * HALF + c)[None, :]
    sin = tl.load(cs_ptr + t * 2 * HALF + HALF + c)[None, :]
    _rotate(q_ptr, q_ptr, t, stride_qt, stride_qh, cos, sin, 0.0, QH, BLOCK_QH, HALF, False)
    _rotate(k_ptr, k_ptr, t, stride_kt, stride_kh, cos, sin, 0.0, KH, BLOCK_KH, HALF, False)


def _check_layouts(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[int, int, int]:
    """(tokens, heads, head_dim) once q, k and cos_sin are laid out as the kernels read them."""
    tokens, heads, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with a contiguous last dim")
    if cos_sin.shape != (tokens, dim) or not cos_sin.is_contiguous() or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be a contiguous float32 [{tokens}, {dim}]; got {tuple(cos_sin.shape)}")
    if dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {dim}")
    return tokens, heads, dim


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous; may be views of qkv), cos_sin [T, D] float32."""
    tokens, heads, dim = _check_layouts(q, k, cos_sin)
    if tokens:
        _rope_kernel[(tokens,)](q, k, cos_sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), QH=heads,
                                KH=k.shape[1], BLOCK_QH=triton.next_power_of_2(heads),
                                BLOCK_KH=triton.next_power_of_2(k.shape[1]), HALF=dim // 2)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cs_ptr, stride_qt, stride_qh, stride_kt, stride_kh, eps,
                         QH: tl.constexpr, KH: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                         HALF: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + t * 2 * HALF + c)[None, :]
    sin = tl.load(cs_ptr + t * 2 * HALF + HALF + c)[None, :]
    _rotate(q_ptr, qw_ptr, t, stride_qt, stride_qh, cos, sin, eps, QH, BLOCK_QH, HALF, True)
    _rotate(k_ptr, kw_ptr, t, stride_kt, stride_kh, cos, sin, eps, KH, BLOCK_KH, HALF, True)


def qk_norm_rope_inplace(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, cos_sin: torch.Tensor) -> None:
    """Per-head RMSNorm (weights [D], one eps) then RoPE, in place; layouts as rope_inplace."""
    tokens, heads, dim = _check_layouts(q, k, cos_sin)
    if q_weight.shape != (dim,) or k_weight.shape != (dim,) or not (q_weight.is_contiguous() and k_weight.is_contiguous()):
        raise ValueError(f"the norm weights must be contiguous [{dim}]; got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    if tokens:
        _qk_norm_rope_kernel[(tokens,)](q, k, q_weight, k_weight, cos_sin, q.stride(0), q.stride(1), k.stride(0),
                                        k.stride(1), eps, QH=heads, KH=k.shape[1],
                                        BLOCK_QH=triton.next_power_of_2(heads),
                                        BLOCK_KH=triton.next_power_of_2(k.shape[1]), HALF=dim // 2)
