"""Decode attention made for multi-head latent attention (DeepSeek-V2/V3, models/mla.py):
every query head of a sequence over its one cached latent a token, split into the latent's
DL dims and the rope key's DR dims, with the latent as the value.

A cache row (one token, the layer's one plane) is [c | k_pe], DL + DR dims (DeepSeek: 512 +
64). Query head h is [q_lat_h | q_pe_h] (W_UK absorbed into it, mla.py), and

    score_h(p) = scale * (q_lat_h . c_p + q_pe_h . k_pe_p)
    out_h      = sum_p softmax_p(score_h(p)) c_p                  [B, H, DL], not DL + DR

Stage 1: program (b, head block, s) takes BLOCK_H query heads of sequence b over split s
of its context, cut as decode_attention.py cuts it (a fixed NUM_SPLITS, the split lengths
computed on the device, so a CUDA graph replays it):

    context  [0 ............................................ seq_len)
    splits   [0, L) [L, 2L) ... [(S-1)L, seq_len)      L = cdiv(seq_len, S) rounded up to BLOCK_N

Each tile of BLOCK_N cache rows is loaded once, as its latent part [BLOCK_N, DL] and its
rope part [BLOCK_N, DR], and feeds all the block's heads: two tl.dots for the scores (q_lat
against c, q_pe against k_pe) and one for the values (p against the same c). The generic
kernel (decode_attention.py) pads the 576-dim head to 1024 for one tl.dot, computing 1.8x
the dims and holding a 1024-wide accumulator; here each part is padded on its own to a
power of two >= 16 (BLOCK_DL, BLOCK_DR: none at DeepSeek's sizes) and the accumulator is
the DL value dims alone.

BLOCK_H: 16 heads (tl.dot's least M) for up to 16 heads, else 32, whose BLOCK_H x DL float32
accumulator is 16K elements at DL 512 (decode_attention's MAX_ACC, what eight warps hold):
DeepSeek-V2-Lite's 16 heads read each tile once per split, V3's 128 four times (the generic
kernel: eight). Heads past the count (20 heads: 32 rows, 12 masked) load 0 and store nothing.

Stage 2 merges the S partials of each (b, head) with decode_attention's merge kernel (D =
DL); with S == 1 stage 1 writes the output itself. A sequence of no context (graph padding)
gets output 0. An fp8 cache is read as kernels/paged.py says: k_scale folds into the
softmax scale, v_scale multiplies the output (one plane: the runner gives both the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.decode_attention import _decode_merge_kernel
from ember.kernels.paged import (
    LOG2E,
    dot_in_fp16,
    is_fp8,
    kv_scale_arg,
    queries_for_dot,
    tile_mask,
    tile_rows,
)

MIN_PART_DIM = 8  # either part's dims, padded to >= 16 inside the kernel (tl.dot's least K)


def mla_block_h(heads: int) -> int:
    """The query heads a program holds (see the top): 16 up to 16 heads, else 32."""
    return 16 if heads <= 16 else 32


def mla_head_blocks(heads: int) -> int:
    """Programs a sequence's split takes: its heads in blocks of mla_block_h."""
    return triton.cdiv(heads, mla_block_h(heads))


def mla_decode_config(block_h: int) -> tuple[int, int, int]:
    """BLOCK_N, num_warps, num_stages: 32-row tiles (36 KB of bfloat16 at 576 dims a stage),
    four warps for 16 heads and eight for 32. Chosen by size, not yet swept on a GPU
    (benchmarks/scripts/mla_decode_bench.py times the alternatives)."""
    return 32, 4 if block_h <= 16 else 8, 2


# the block-table width changes from step to step outside CUDA graphs: not specialized on
@triton.jit(do_not_specialize=["stride_tb"])
def _mla_split_kernel(q_ptr, cache_ptr, tables_ptr, seq_lens_ptr, o_ptr, lse_ptr, k_scale_ptr, v_scale_ptr,
                      scale_log2, stride_qt, stride_qh, stride_tb, stride_cb, stride_cs, stride_ob, stride_oh,
                      stride_os, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, DL: tl.constexpr,
                      BLOCK_DL: tl.constexpr, DR: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, DOT_FP16: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    q_rows = q_ptr + b * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + dl[None, :], mask=tile_mask(hmask, dl, DL, BLOCK_DL), other=0.0)
    q_pe = tl.load(q_rows + DL + dr[None, :], mask=tile_mask(hmask, dr, DR, BLOCK_DR), other=0.0)
    if FP8:  # the cache holds x / k_scale: q.x = k_scale * (q.(x / k_scale))
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    q_lat = queries_for_dot(q_lat, DOT_FP16)  # the dots' dtype: q's, or float16 over fp8 (paged.py)
    q_pe = queries_for_dot(q_pe, DOT_FP16)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pmask = n0 + tl.arange(0, BLOCK_N) < end
        rows = cache_ptr + tile_rows(tables_ptr + b * stride_tb, n0, pmask, stride_cb, stride_cs, PAGE, BLOCK_N)
        c = tl.load(rows[:, None] + dl[None, :], mask=tile_mask(pmask, dl, DL, BLOCK_DL), other=0.0)
        k_pe = tl.load(rows[:, None] + DL + dr[None, :], mask=tile_mask(pmask, dr, DR, BLOCK_DR), other=0.0)
        c = c.to(q_lat.dtype)
        qk = tl.dot(q_pe, tl.trans(k_pe.to(q_lat.dtype)), tl.dot(q_lat, tl.trans(c)))
        qk = tl.where(pmask[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 domain
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c)
        m = m_new

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    o_off = b * stride_ob + heads[:, None] * stride_oh + dl[None, :]
    o_mask = tile_mask(hmask, dl, DL, BLOCK_DL)
    if NUM_SPLITS == 1:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptr + o_off + s * stride_os, out, mask=o_mask)
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * HEADS + heads) * NUM_SPLITS + s, lse, mask=hmask)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, latent_dim: int, num_splits: int, out: torch.Tensor | None = None,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, block_h: int | None = None,
               block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence: latent_dim latent dims, then D - latent_dim rope
    dims), cache [num_blocks, block_size, 1, D] (the layer's one plane) in q's dtype or fp8
    (then k_scale / v_scale: [1] float32, None: 1.0), block_tables [B, >= cdiv(max seq_len,
    block_size)] int32, seq_lens [B] int32 (0: no context, output 0). Returns [B, H,
    latent_dim]: each head's softmax-weighted latents. `out` may be a view (its last dim
    contiguous); block_h ... num_stages override the tiles (mla_block_h, mla_decode_config)."""
    batch, heads, dim = q.shape
    rope_dim = dim - latent_dim
    fp8 = is_fp8(cache)
    if cache.dim() != 4 or cache.shape[2:] != (1, dim) or (cache.dtype != q.dtype and not fp8):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit a latent cache {tuple(cache.shape)} "
                         f"{cache.dtype} ([num_blocks, block_size, 1, {dim}] in q's dtype or fp8)")
    if latent_dim < MIN_PART_DIM or rope_dim < MIN_PART_DIM:
        raise ValueError(f"latent_dim {latent_dim} must leave both parts of the {dim} dims at least "
                         f"{MIN_PART_DIM} dims")
    if q.stride(2) != 1 or not cache.is_contiguous():
        raise ValueError("q's last dim and the cache must be contiguous")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,) or block_tables.dtype != torch.int32 \
            or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, W] int32 with contiguous rows and seq_lens [{batch}] "
                         f"int32; got {tuple(block_tables.shape)} {block_tables.dtype}, {tuple(seq_lens.shape)} "
                         f"{seq_lens.dtype}")
    if out is None:
        out = torch.empty(batch, heads, latent_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (batch, heads, latent_dim) or out.stride(2) != 1:
        raise ValueError(f"out must be [{batch}, {heads}, {latent_dim}] with its last dim contiguous, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if batch == 0:
        return out
    block_h = block_h or mla_block_h(heads)
    config = mla_decode_config(block_h)
    block_dl, block_dr = (max(16, triton.next_power_of_2(n)) for n in (latent_dim, rope_dim))
    grid = (batch, triton.cdiv(heads, block_h), num_splits)
    common = dict(HEADS=heads, BLOCK_H=block_h, DL=latent_dim, BLOCK_DL=block_dl, DR=rope_dim, BLOCK_DR=block_dr,
                  BLOCK_N=block_n or config[0], PAGE=cache.shape[1], NUM_SPLITS=num_splits, FP8=fp8,
                  DOT_FP16=dot_in_fp16(q, cache), num_warps=num_warps or config[1],
                  num_stages=num_stages or config[2])
    args = (q, cache, block_tables, seq_lens)
    scales = (kv_scale_arg(k_scale, cache), kv_scale_arg(v_scale, cache), scale * LOG2E)
    strides = (q.stride(0), q.stride(1), block_tables.stride(0), cache.stride(0), cache.stride(1))
    if num_splits == 1:
        _mla_split_kernel[grid](*args, out, out, *scales, *strides, out.stride(0), out.stride(1), 0, **common)
        return out
    part = torch.empty(batch, heads, num_splits, latent_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    _mla_split_kernel[grid](*args, part, lse, *scales, *strides, part.stride(0), part.stride(1), part.stride(2),
                            **common)
    _decode_merge_kernel[(batch, heads)](part, lse, out, part, part.stride(0), part.stride(1), part.stride(2),
                                         out.stride(0), out.stride(1), NUM_HEADS=heads, D=latent_dim,
                                         BLOCK_D=block_dl, NUM_SPLITS=num_splits,
                                         BLOCK_S=triton.next_power_of_2(num_splits), SINKS=False)
    return out
