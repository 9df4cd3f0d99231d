"""Write the step's new K/V rows into the paged cache at their slots.

    k, v      [T, Hkv, D]               (a token's heads contiguous; rows may be strided)
    cache     [num_blocks, block_size, Hkv, D]   contiguous; slot s = block * block_size + offset
    slots     [T] int64; a slot < 0 (padding in a CUDA graph) writes nothing
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, BLOCK)
        mask = cols < ROW
        k = tl.load(k_ptr + t * stride_k + cols, mask=mask)
        v = tl.load(v_ptr + t * stride_v + cols, mask=mask)
        dst = slot.to(tl.int64) * ROW + cols
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"{name} must be [T, Hkv, D] with each token's heads contiguous; "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}")


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _check_rows(k, "k")
    _check_rows(v, "v")
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"shapes disagree: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the K/V caches must be contiguous [num_blocks, block_size, Hkv, D]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _kv_write_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=triton.next_power_of_2(row))
