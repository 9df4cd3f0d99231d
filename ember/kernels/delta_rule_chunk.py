"""The gated delta rule's state carried through a step's prefill chunks (Qwen3-Next's linear
attention, models/gated_deltanet.py): the sequential half of `delta_rule_chunked`.

What a chunk contributes whatever state it starts from (its ChunkTerms: Wk, Wv, exp(G) Q, the
masked QK^T * D, the decayed keys, its decay) is computed for every chunk of every sequence at
once, as batched matrix products (models/gated_deltanet.chunk_terms). This kernel then walks
each sequence's chunks in order from the state in its slot, three matrix products a chunk:

    U  = Wv - Wk S                       [BT, dv]
    O  = exp(G) Q S + (QK^T * D) U       [BT, dv]
    S  = exp(G(BT)) S + (D(BT, i) K)^T U

and writes the last S back to the slot. Program (s, h, vb) holds S's columns [vb * BLOCK_V,
(vb + 1) * BLOCK_V) of value head h of sequence s in registers throughout (columns of S are
independent). The terms come chunk-major, [chunks, H, BT, ...], a sequence's chunks
chunk_starts[s] .. chunk_starts[s + 1] - 1; rows past a sequence's last token are zero terms
(padding), which leave S as it is. The products are in float32 ("ieee": no TF32), as the torch
path's; nothing is read on the host, slots included (-1: no state read or written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # with 8 warps: S's [dk, 32] columns and a chunk's [64, dk] terms in registers (untuned)
# no software pipelining of the chunk loop: its float32 [64, 128] terms, three stages deep, asked
# for 256 KiB of shared memory at Qwen3-Next's shapes (the H100 has 227); one stage takes 112 KiB,
# two programs an SM
NUM_STAGES = 1


@triton.jit(do_not_specialize=["chunk_starts_ptr", "slots_ptr"])
def _delta_rule_chunk_kernel(wk_ptr, wv_ptr, qg_ptr, p_ptr, kd_ptr, decay_ptr, state_ptr, chunk_starts_ptr, slots_ptr,
                             o_ptr, stride_slot, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                             BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + s)
    t = tl.arange(0, BT)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = (dk < DK)[None, :]
    vmask = (dv < DV)[None, :]
    smask = (dk < DK)[:, None] & (dv < DV)[None, :]
    state = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S = tl.load(state, mask=smask & (slot >= 0), other=0.0)
    first = tl.load(chunk_starts_ptr + s).to(tl.int64)  # offsets in int64
    for c in range(first, tl.load(chunk_starts_ptr + s + 1).to(tl.int64)):
        row = (c * H + h) * BT + t  # the chunk's rows of head h
        keys = row[:, None] * DK + dk[None, :]
        values = row[:, None] * DV + dv[None, :]
        wk = tl.load(wk_ptr + keys, mask=kmask, other=0.0)
        qg = tl.load(qg_ptr + keys, mask=kmask, other=0.0)
        kd = tl.load(kd_ptr + keys, mask=kmask, other=0.0)
        wv = tl.load(wv_ptr + values, mask=vmask, other=0.0)
        p = tl.load(p_ptr + row[:, None] * BT + t[None, :])
        u = wv - tl.dot(wk, S, input_precision="ieee")
        o = tl.dot(qg, S, input_precision="ieee") + tl.dot(p, u, input_precision="ieee")
        tl.store(o_ptr + values, o, mask=vmask)
        S = S * tl.load(decay_ptr + c * H + h) + tl.dot(tl.trans(kd), u, input_precision="ieee")
    if slot >= 0:
        tl.store(state, S, mask=smask)


def delta_rule_chunk_pass(wk: torch.Tensor, wv: torch.Tensor, qg: torch.Tensor, p: torch.Tensor, kd: torch.Tensor,
                          decay: torch.Tensor, state: torch.Tensor, chunk_starts: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor:
    """o [chunks, H, BT, dv] float32 of every chunk from its terms (ChunkTerms' fields, in their
    order): wk, qg, kd [chunks, H, BT, dk], wv [chunks, H, BT, dv], p [chunks, H, BT, BT], decay
    [chunks, H], all float32 and contiguous; state
    [slots, H, dk, dv] float32 (carried through and updated in place at slots [S] int64),
    chunk_starts [S + 1] int32 (sequence s's chunks)."""
    chunks, heads, bt, dk = wk.shape
    dv = wv.shape[-1]
    terms = (wk, wv, qg, p, kd, decay)
    if any(x.dtype != torch.float32 or not x.is_contiguous() for x in (*terms, state[0])) \
            or qg.shape != wk.shape or kd.shape != wk.shape or wv.shape != (chunks, heads, bt, dv) \
            or p.shape != (chunks, heads, bt, bt) or decay.shape != (chunks, heads) \
            or state.shape[1:] != (heads, dk, dv):
        raise ValueError(f"the terms of {chunks} chunks of {bt} tokens and the state must be float32, contiguous and "
                         f"shaped alike; got wk {tuple(wk.shape)}, wv {tuple(wv.shape)}, p {tuple(p.shape)}, decay "
                         f"{tuple(decay.shape)}, state {tuple(state.shape)}")
    if slots.dtype != torch.int64 or chunk_starts.shape[0] != slots.shape[0] + 1 or bt < 16 or bt & (bt - 1):
        raise ValueError("slots must be int64 [S], chunk_starts [S + 1], the chunk a power of two >= 16")
    o = torch.empty(chunks, heads, bt, dv, dtype=torch.float32, device=wk.device)
    if slots.shape[0] == 0:
        return o
    grid = (slots.shape[0], heads, triton.cdiv(dv, BLOCK_V))
    _delta_rule_chunk_kernel[grid](wk, wv, qg, p, kd, decay, state, chunk_starts, slots, o, state.stride(0),
                                   H=heads, DK=dk, DV=dv, BT=bt, BLOCK_K=max(16, triton.next_power_of_2(dk)),
                                   BLOCK_V=BLOCK_V, num_warps=8, num_stages=NUM_STAGES)
    return o
