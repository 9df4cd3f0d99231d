"""Write the step's new K/V rows into the paged cache at their slots.

    k, v      [T, Hkv, D]               (a token's heads contiguous; rows may be strided)
    cache     [num_blocks, block_size, Hkv, D]   contiguous; slot s = block * block_size + offset
    slots     [T] int64; a slot < 0 (padding in a CUDA graph) writes nothing

An fp8 cache (float8_e4m3fn) stores x / scale, clamped to +-448 and rounded to nearest even:
the per-tensor k_scale / v_scale ([1] float32, read on the device so a CUDA graph keeps
whatever value they hold at replay). Other caches store x as it is, in their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.paged import FP8_MAX, is_fp8, kv_scale_arg


@triton.jit
def store_rows(cache_ptr, dst, x, mask, scale_ptr, FP8: tl.constexpr):
    """Store x at cache offsets dst: as it is, or for an fp8 cache x / scale clamped to
    +-448, divided as IEEE does (div_rn, as torch's x / scale, so both round alike)."""
    if FP8:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -FP8_MAX, FP8_MAX)
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        dst = slot.to(tl.int64) * ROW + cols
        store_rows(k_cache_ptr, dst, tl.load(k_ptr + t * stride_k + cols, mask=mask), mask, k_scale_ptr, FP8)
        store_rows(v_cache_ptr, dst, tl.load(v_ptr + t * stride_v + cols, mask=mask), mask, v_scale_ptr, FP8)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"{name} must be [T, Hkv, D] with each token's heads contiguous; "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}")


def check_kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """The layouts every kernel that writes the cache takes (see the module docstring)."""
    _check_rows(k, "k")
    _check_rows(v, "v")
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:] \
            or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V caches must be contiguous [num_blocks, block_size, Hkv, D]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_scale / v_scale: an fp8 cache's scales ([1] float32 on the device; None: 1.0);
    ignored for other caches."""
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    fp8 = is_fp8(k_cache)
    k_scale, v_scale = kv_scale_arg(k_scale, k_cache), kv_scale_arg(v_scale, v_cache)
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _kv_write_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row), FP8=fp8)
