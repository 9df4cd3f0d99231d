"""Rotary embedding (rotate-half layout) applied in place to q and k, one program per token.

    cos_sin  [T, R]: cos | sin of each token's position (R/2 each), looked up once per forward
    x        [T, heads, D]: x[..., :R/2] and x[..., R/2:R] are a head's pairs, x[..., R:] passes
    out1 = x1 cos - x2 sin,  out2 = x2 cos + x1 sin   (float32, rounded to x's dtype)

R = D but for partial RoPE (Phi-4-mini: R 96 of D 128; Phi-2: R 32 of D 80), where the dims
after R are kept. D need not be a power of two (Phi-2's 80, Phi-3-mini's 96): the halves, the
passed dims and the v rows are each padded to a power of two inside the kernel, masked (a
power-of-two D builds no mask for v's rows).
With NORM (`qk_norm_rope_inplace`) Qwen3's per-head RMSNorm goes first, in the same program,
over all D dims: the normalized head is rounded to x's dtype as layers/norm.py rounds it, then
rotated. Given the paged cache (`k_cache` ...), the program also stores the rotated k and the v
rows at the token's slot, as kernels/kv_write.py would (fp8 included): the KV-write kernel is
then skipped. One kernel where norm + norm + rope + write took four.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.kv_write import check_kv_write, store_rows
from ember.kernels.paged import is_fp8, kv_scale_arg


@triton.jit
def _rotate(x_ptr, w_ptr, t, stride_t, stride_h, cos, sin, eps, HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_PASS: tl.constexpr,
            NORM: tl.constexpr):
    """Rotate token t's heads in place; with NORM, RMSNorm each head (weight w_ptr) first.
    Returns the two rotated halves [BLOCK_H, BLOCK_HALF] and the PASS dims after them
    [BLOCK_H, BLOCK_PASS] (with PASS 0, the first half again), in x's dtype."""
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    heads = (h < HEADS)[:, None]
    mask = heads & (c < HALF)[None, :]
    row = x_ptr + t * stride_t + h[:, None] * stride_h
    x1 = tl.load(row + c[None, :], mask=mask, other=0.0)
    x2 = tl.load(row + HALF + c[None, :], mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if PASS > 0:  # partial RoPE: the dims after the rotary ones
        p = tl.arange(0, BLOCK_PASS)
        pass_mask = heads & (p < PASS)[None, :]
        x3 = tl.load(row + 2 * HALF + p[None, :], mask=pass_mask, other=0.0)
    else:
        x3 = x1
    if NORM:  # rounded to x's dtype as RMSNorm's output is, then rotated
        squares = tl.sum(a * a, 1) + tl.sum(b * b, 1)
        if PASS > 0:
            e = x3.to(tl.float32)
            squares += tl.sum(e * e, 1)
        inv = tl.rsqrt(squares / (2 * HALF + PASS) + eps)[:, None]
        w1 = tl.load(w_ptr + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        a = (w1 * (a * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        if PASS > 0:  # normalized, not rotated
            w3 = tl.load(w_ptr + 2 * HALF + p, mask=p < PASS, other=0.0).to(tl.float32)[None, :]
            x3 = (w3 * (e * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            tl.store(row + 2 * HALF + p[None, :], x3, mask=pass_mask)
    out1 = (a * cos - b * sin).to(x1.dtype)
    out2 = (b * cos + a * sin).to(x1.dtype)
    tl.store(row + c[None, :], out1, mask=mask)
    tl.store(row + HALF + c[None, :], out2, mask=mask)
    return out1, out2, x3


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cs_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                 v_scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, eps, QH: tl.constexpr,
                 KH: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, DIM: tl.constexpr,
                 BLOCK_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
                 BLOCK_PASS: tl.constexpr, NORM: tl.constexpr, WRITE_KV: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    c = tl.arange(0, BLOCK_HALF)
    if WRITE_KV:  # every load first, none behind another: the kernel is latency-bound
        slot = tl.load(slot_ptr + t)
        h = tl.arange(0, BLOCK_KH)[:, None]
        d = tl.arange(0, BLOCK_DIM)[None, :]
        v_mask = h < KH
        if BLOCK_DIM != DIM:  # D padded to a power of two
            v_mask = v_mask & (d < DIM)
        v = tl.load(v_ptr + t * stride_vt + h * DIM + d, mask=v_mask)
    cos = tl.load(cs_ptr + t * 2 * HALF + c, mask=c < HALF, other=0.0)[None, :]
    sin = tl.load(cs_ptr + t * 2 * HALF + HALF + c, mask=c < HALF, other=0.0)[None, :]
    _rotate(q_ptr, qw_ptr, t, stride_qt, stride_qh, cos, sin, eps, QH, BLOCK_QH, HALF, BLOCK_HALF, PASS, BLOCK_PASS,
            NORM)
    k1, k2, k3 = _rotate(k_ptr, kw_ptr, t, stride_kt, stride_kh, cos, sin, eps, KH, BLOCK_KH, HALF, BLOCK_HALF, PASS,
                         BLOCK_PASS, NORM)
    if WRITE_KV:
        mask = (h < KH) & (slot >= 0)  # a CUDA graph's padded row (slot -1) writes nothing
        row = tl.maximum(slot, 0).to(tl.int64) * (KH * DIM) + h * DIM
        half_mask = mask & (c < HALF)[None, :]
        store_rows(k_cache_ptr, row + c[None, :], k1, half_mask, k_scale_ptr, FP8)
        store_rows(k_cache_ptr, row + HALF + c[None, :], k2, half_mask, k_scale_ptr, FP8)
        if PASS > 0:
            p = tl.arange(0, BLOCK_PASS)[None, :]
            store_rows(k_cache_ptr, row + 2 * HALF + p, k3, mask & (p < PASS), k_scale_ptr, FP8)
        if BLOCK_DIM != DIM:
            mask = mask & (d < DIM)
        store_rows(v_cache_ptr, row + d, v, mask, v_scale_ptr, FP8)


def _check_layouts(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, head_dim, rotary_dim) once q, k and cos_sin are laid out as the kernels read them."""
    tokens, heads, dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != dim or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] with a contiguous last dim")
    rotary = cos_sin.shape[-1]
    if cos_sin.shape != (tokens, rotary) or not cos_sin.is_contiguous() or cos_sin.dtype != torch.float32 \
            or rotary % 2 or not 0 < rotary <= dim:
        raise ValueError(f"cos_sin must be a contiguous float32 [{tokens}, R], R even and at most {dim}; "
                         f"got {tuple(cos_sin.shape)}")
    return tokens, heads, dim, rotary


def _launch(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, weights: tuple | None, eps: float,
            v: torch.Tensor | None, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
            slot_mapping: torch.Tensor | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    tokens, heads, dim, rotary = _check_layouts(q, k, cos_sin)
    write = k_cache is not None
    if write:
        check_kv_write(k, v, k_cache, v_cache, slot_mapping)
        k_scale, v_scale = kv_scale_arg(k_scale, k_cache), kv_scale_arg(v_scale, v_cache)
    if not tokens:
        return
    qw, kw = weights if weights is not None else (q, k)
    cache = (v, k_cache, v_cache, slot_mapping, k_scale, v_scale) if write else (q,) * 6  # placeholders: unread
    passed = dim - rotary
    _rope_kernel[(tokens,)](q, k, qw, kw, cos_sin, *cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                            v.stride(0) if write else 0, eps, QH=heads, KH=k.shape[1],
                            BLOCK_QH=triton.next_power_of_2(heads), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
                            DIM=dim, BLOCK_DIM=triton.next_power_of_2(dim), HALF=rotary // 2,
                            BLOCK_HALF=triton.next_power_of_2(rotary // 2), PASS=passed,
                            BLOCK_PASS=triton.next_power_of_2(passed) if passed else 1,
                            NORM=weights is not None, WRITE_KV=write, FP8=write and is_fp8(k_cache))


def rope_inplace(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, v: torch.Tensor | None = None,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous; may be views of qkv), cos_sin [T, R]
    float32 (R < D: the first R dims of each head turn). Given k_cache, also writes the rotated
    k and v ([T, Hkv, D], heads contiguous) into the caches at slot_mapping, as
    kernels/kv_write.kv_write takes them."""
    _launch(q, k, cos_sin, None, 0.0, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def qk_norm_rope_inplace(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, cos_sin: torch.Tensor, v: torch.Tensor | None = None,
                         k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                         slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> None:
    """Per-head RMSNorm (weights [D], one eps) then RoPE, in place; layouts and the cache
    write as rope_inplace."""
    dim = q.shape[-1]
    if q_weight.shape != (dim,) or k_weight.shape != (dim,) or not (q_weight.is_contiguous() and k_weight.is_contiguous()):
        raise ValueError(f"the norm weights must be contiguous [{dim}]; got {tuple(q_weight.shape)}, {tuple(k_weight.shape)}")
    _launch(q, k, cos_sin, (q_weight, k_weight), eps, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
