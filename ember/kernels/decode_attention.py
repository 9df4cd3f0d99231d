"""Decode attention over the paged KV cache: one new query token per sequence, split along
the context (flash-decoding) so that a small batch still fills the GPU.

Stage 1: program (b, kv_head, s) takes split s of sequence b's context,

    context  [0 ............................................ seq_len)
    splits   [0, L) [L, 2L) ... [(S-1)L, seq_len)      L = cdiv(seq_len, S) rounded up to BLOCK_N

and attends the GROUP query heads that share kv_head (GQA, padded to BLOCK_H >= 16 rows
for tl.dot) over it: a partial output and its log-sum-exp. A split past the context writes
lse = -inf. Stage 2 merges the S partials of each (b, head). With S == 1 stage 1 writes
the output itself.

The key at context position p is at k_cache[block_tables[b, p // block_size], p % block_size].
Everything the kernels read is on the GPU (no host lengths), so a CUDA graph replays them.
An fp8 cache is read as kernels/paged.py says: k_scale folds into the softmax scale, v_scale
multiplies the split's output.

Variants of the split kernel (the `variant` argument, "+"-joined; "" is the plain one),
all exact to the same result, for making an fp8 cache's read memory-bound (the plain
kernel's fp8 tile goes through shared memory as the dot's B operand, converted):
  kt     K loaded as [D, BLOCK_N] by addressing (SGLang / vLLM's way): scores = q . K^T
         without a tl.trans
  ka     K as the dot's A operand: scores^T [BLOCK_N, BLOCK_H] = K q^T, softmax along axis
         0. With BLOCK_N >= 64 the dot can be a Hopper wgmma (M = BLOCK_N), whose A operand
         may stay in registers (Triton's mixed-precision path upcasts the fp8 tile there);
         the plain kernel's M = BLOCK_H = 16 is an mma.sync
  va     V^T as the A operand too: out^T [D, BLOCK_H] += V^T P^T, V loaded as [D, BLOCK_N]
  pages  the block table read once per page of a tile, not once per position (offline
         compiles show it loses the cp.async pipelining: the reshape of the offsets)
  i32    int32 offsets into the cache (applied only where the cache has < 2^31 elements)
  vreg   V converted in registers in its load layout (paged.in_registers), then moved to the
         dot's layout in 16 bits. Offline compiles for sm_90 show why the fp8 cache is slow:
         the plain kernel reads the fp8 V tile from shared memory straight into the dot's B
         layout, which pairs positions (strided), one ld.shared.b8 per element (128 per
         thread per 128-position tile); with vreg it is vector loads + ldmatrix.trans
         (0 byte loads; +32 KB of shared memory for the fp16 copy)
  kreg   the same for K (K's plain path already reads 8-byte vectors)
benchmarks/scripts/decode_variants.py times them on the GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels.paged import (LOG2E, dot_in_fp16, is_fp8, in_registers, kv_offsets, kv_scale_arg, load_rows,
                                 queries_for_dot)

# BLOCK_N, num_warps, num_stages of the split kernel, from benchmarks/scripts/decode_sweep.py on
# the H200 (3.99 / 4.37 TB/s of KV at the Qwen3-0.6B / Llama-8B benchmark shapes);
# EMBER_DECODE_CONFIG="64,4,3" overrides, for sweeps
DECODE_CONFIG = tuple(int(x) for x in os.environ.get("EMBER_DECODE_CONFIG", "128,4,4").split(","))

# the split kernel's variants (see the module docstring), "+"-joined; "" is the plain one.
# EMBER_DECODE_VARIANT="ka+va" overrides the default, for sweeps
VARIANT_FLAGS = {"kt": "K_T", "ka": "K_A", "va": "V_A", "pages": "PAGE_IDS", "i32": "OFF32",
                 "kreg": "K_REG", "vreg": "V_REG"}
DECODE_VARIANT = os.environ.get("EMBER_DECODE_VARIANT", "")


def variant_flags(variant: str, page: int, block_n: int, cache: torch.Tensor) -> dict[str, bool]:
    """The split kernel's constexpr flags for `variant`. "pages" applies where a tile holds
    whole pages (block_n a multiple of a power-of-two page), "i32" where every offset into
    the cache fits in int32; elsewhere they are dropped (same result, per-position reads)."""
    names = [x for x in variant.split("+") if x]
    unknown = set(names) - VARIANT_FLAGS.keys()
    if unknown or ("kt" in names and "ka" in names):
        raise ValueError(f"unknown decode variant {variant!r}: '+'-join some of {list(VARIANT_FLAGS)} "
                         "(kt and ka exclude each other)")
    flags = {flag: name in names for name, flag in VARIANT_FLAGS.items()}
    flags["PAGE_IDS"] &= page & (page - 1) == 0 and block_n % page == 0
    flags["OFF32"] &= cache.numel() < 2 ** 31
    return flags


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, o_ptr, lse_ptr,
                         k_scale_ptr, v_scale_ptr, scale_log2, stride_qt, stride_qh, stride_tb, stride_cb, stride_cs,
                         stride_ch, stride_ob, stride_oh, stride_os,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr,
                         DOT_FP16: tl.constexpr, K_T: tl.constexpr, K_A: tl.constexpr, V_A: tl.constexpr,
                         PAGE_IDS: tl.constexpr, OFF32: tl.constexpr, K_REG: tl.constexpr,
                         V_REG: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    hmask = rows < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if FP8:  # the cache holds K / k_scale and V / v_scale: q.K = k_scale * (q.(K / k_scale))
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    q = queries_for_dot(q, DOT_FP16)  # the dots' dtype: q's, or float16 over fp8 (see paged.py)
    q_t = tl.trans(q)  # [D, BLOCK_H]: the B operand with K_A

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    if V_A:
        acc = tl.zeros([D, BLOCK_H], tl.float32)  # the output transposed
    else:
        acc = tl.zeros([BLOCK_H, D], tl.float32)
    table_row = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pmask = n0 + tl.arange(0, BLOCK_N) < end
        off = kv_offsets(table_row, n0, end, kvh, stride_cb, stride_cs, stride_ch, PAGE, BLOCK_N, PAGE_IDS, OFF32)
        k = load_rows(k_cache_ptr, off, pmask, d, K_T).to(q.dtype)  # [D, BLOCK_N] with K_T, else [BLOCK_N, D]
        if K_REG:
            k = in_registers(k, k.shape[0], k.shape[1])
        v = load_rows(v_cache_ptr, off, pmask, d, V_A).to(q.dtype)  # [D, BLOCK_N] with V_A, else [BLOCK_N, D]
        if V_REG:
            v = in_registers(v, v.shape[0], v.shape[1])
        # the scores in the log2 domain, and p = exp2(scores - running max): [BLOCK_H, BLOCK_N],
        # or [BLOCK_N, BLOCK_H] with K_A (K the dot's A operand, softmax along axis 0)
        if K_A:
            qk = tl.dot(k, q_t) * scale_log2
            qk = tl.where(pmask[:, None], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 0))
            p = tl.exp2(qk - m_new[None, :])
            l_add = tl.sum(p, 0)
        else:
            if K_T:
                qk = tl.dot(q, k) * scale_log2
            else:
                qk = tl.dot(q, tl.trans(k)) * scale_log2
            qk = tl.where(pmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m, tl.max(qk, 1))
            p = tl.exp2(qk - m_new[:, None])
            l_add = tl.sum(p, 1)
        alpha = tl.exp2(m - m_new)
        l = l * alpha + l_add
        if K_A != V_A:  # P in the orientation the second dot takes
            p = tl.trans(p)
        if V_A:  # acc^T += V^T P^T
            acc = acc * alpha[None, :] + tl.dot(v, p.to(q.dtype))
        else:  # acc += P V
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new
    if V_A:
        acc = tl.trans(acc)

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    if FP8:
        out = out * tl.load(v_scale_ptr)
    o_off = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        tl.store(o_ptr + o_off + s * stride_os, out, mask=hmask[:, None])
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + s, lse, mask=hmask)


@triton.jit
def _decode_merge_kernel(part_ptr, lse_ptr, o_ptr, stride_pb, stride_ph, stride_ps, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + (b * NUM_HEADS + h) * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty sequence (graph padding): output 0
    w = tl.exp2(lse - top)
    d = tl.arange(0, D)
    part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                   mask=smask[:, None], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def num_decode_splits(batch: int, num_kv_heads: int, max_splits: int = 32, target_programs: int = 528) -> int:
    """Enough splits that batch x kv_heads x splits fills the GPU (~4 programs per SM of
    an H200's 132); a function of the batch size alone, so a CUDA graph fixes it. A power
    of two: few kernel variants to compile."""
    want = min(max_splits, -(-target_programs // (batch * num_kv_heads)))
    return 1 << max(0, want - 1).bit_length()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int, out: torch.Tensor | None = None,
                     block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     variant: str | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence), caches [num_blocks, block_size, Hkv, D] in q's
    dtype or fp8 (then k_scale / v_scale: [1] float32, None: 1.0), block_tables
    [B, >= cdiv(max seq_len, block_size)] int32, seq_lens [B] int32 (0: no context,
    output 0). `variant`: the split kernel's (VARIANT_FLAGS; None: DECODE_VARIANT).
    Returns [B, H, D]."""
    batch, heads, dim = q.shape
    num_blocks, page, kv_heads, cdim = k_cache.shape
    fp8 = is_fp8(k_cache)
    if cdim != dim or heads % kv_heads or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype \
            or (k_cache.dtype != q.dtype and not fp8):
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(k_cache.shape)} {k_cache.dtype} "
                         f"/ {tuple(v_cache.shape)} {v_cache.dtype}")
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q's last dim and the caches must be contiguous")
    k_scale, v_scale = kv_scale_arg(k_scale, k_cache), kv_scale_arg(v_scale, v_cache)
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,) or block_tables.dtype != torch.int32 \
            or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables must be [{batch}, W] int32 and seq_lens [{batch}] int32; got "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}, {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {dim}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    block_h = max(16, triton.next_power_of_2(group))
    block_n = block_n or DECODE_CONFIG[0]
    flags = variant_flags(DECODE_VARIANT if variant is None else variant, page, block_n, k_cache)
    grid = (batch, kv_heads, num_splits)
    common = dict(GROUP=group, BLOCK_H=block_h, D=dim, BLOCK_N=block_n, PAGE=page, NUM_SPLITS=num_splits, FP8=fp8,
                  DOT_FP16=dot_in_fp16(q, k_cache), num_warps=num_warps or DECODE_CONFIG[1],
                  num_stages=num_stages or DECODE_CONFIG[2], **flags)
    scale_log2 = scale * LOG2E
    if num_splits == 1:
        _decode_split_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, out, out, k_scale, v_scale, scale_log2,
                                   q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0),
                                   k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), 0,
                                   **common)
        return out
    part = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, part, lse, k_scale, v_scale, scale_log2,
                               q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0),
                               k_cache.stride(1), k_cache.stride(2), part.stride(0), part.stride(1),
                               part.stride(2), **common)
    _decode_merge_kernel[(batch, heads)](part, lse, out, part.stride(0), part.stride(1), part.stride(2),
                                         out.stride(0), out.stride(1), NUM_HEADS=heads, D=dim,
                                         NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits))
    return out
