"""One token of the gated delta rule (Qwen3-Next's linear attention, models/gated_deltanet.py)
for each one-token sequence of a step, its state S [dk, dv] updated in place in its slot:

    q, k   = l2norm(q) / sqrt(dk), l2norm(k)         of the token's key head
    g      = -exp(A_log) * softplus(a + dt_bias)     beta = sigmoid(b)
    S      = exp(g) S
    S      = S + k (beta (v - k^T S))^T
    o      = q^T S

all fused, as the fla library's fused recurrent kernel (which vLLM and SGLang run) fuses them,
in the order of `delta_rule_step`. Program (s, h, vb) takes value head h of sequence s and dv
columns [vb * BLOCK_V, (vb + 1) * BLOCK_V) of its state: every program holds the whole of dk
(the norms and k^T S sum over it) and columns of S are independent.

Sequence s's token is row query_start_loc[s] of the conv's output (q | k | v of every head);
a sequence of another length is not one for this kernel (a mixed step's prefills take the
chunked path) and its programs do nothing. Slots come from a device tensor, so a CUDA graph
replays the kernel; a one-token sequence of slot -1 (a graph's padded row) writes o = 0 and no
state. beta is rounded to the model dtype as the torch path's sigmoid of b rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # torch's softplus: x itself above it


@triton.jit(do_not_specialize=["starts_ptr", "slots_ptr"])
def _delta_rule_decode_kernel(qkv_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, starts_ptr, slots_ptr, o_ptr,
                              stride_qkv, stride_ab, stride_o, stride_slot, scale, eps,
                              GROUP: tl.constexpr, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(starts_ptr + s).to(tl.int64)
    if tl.load(starts_ptr + s + 1) - row == 1:
        slot = tl.load(slots_ptr + s)
        dk = tl.arange(0, BLOCK_K)
        dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask = dk < DK
        vmask = dv < DV
        o_ptrs = o_ptr + row * stride_o + h * DV + dv
        if slot < 0:
            tl.store(o_ptrs, tl.zeros([BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=vmask)
        else:
            x = qkv_ptr + row * stride_qkv
            key = (h // GROUP) * DK + dk
            q = tl.load(x + key, mask=kmask, other=0.0).to(tl.float32)
            k = tl.load(x + KEY_DIM + key, mask=kmask, other=0.0).to(tl.float32)
            v = tl.load(x + 2 * KEY_DIM + h * DV + dv, mask=vmask, other=0.0).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
            b = tl.load(b_ptr + row * stride_ab + h)
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
            a = tl.load(a_ptr + row * stride_ab + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
            softplus = tl.where(a > SOFTPLUS_THRESHOLD, a, tl.log(1.0 + tl.exp(tl.minimum(a, SOFTPLUS_THRESHOLD))))
            g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
            state = state_ptr + slot * stride_slot + h * DK * DV + dk[:, None] * DV + dv[None, :]
            smask = kmask[:, None] & vmask[None, :]
            S = tl.load(state, mask=smask, other=0.0) * tl.exp(g)
            error = v - tl.sum(k[:, None] * S, 0)
            S += k[:, None] * (beta * error)[None, :]
            tl.store(state, S, mask=smask)
            tl.store(o_ptrs, tl.sum(q[:, None] * S, 0).to(o_ptr.dtype.element_ty), mask=vmask)


def delta_rule_decode(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
                      out: torch.Tensor, key_heads: int, eps: float) -> None:
    """The one-token sequences' rows of `out` [T, H, dv]: qkv [T, 2 * key_heads * dk + H * dv]
    (q | k | v after the conv, rows strided), a, b [T, H] (rows strided), a_log, dt_bias [H],
    state [slots, H, dk, dv] float32 (updated in place at slots [S] int64), query_start_loc
    [S + 1] int32. Other rows of `out` are left as they are."""
    heads, dk, dv = state.shape[1:]
    key_dim = key_heads * dk
    if qkv.shape[1] != 2 * key_dim + heads * dv or qkv.stride(1) != 1 or a.shape != b.shape \
            or a.shape[1:] != (heads,) or a.stride(1) != 1 or a.stride() != b.stride() or state.dtype != torch.float32 \
            or not state[0].is_contiguous() or out.shape != (qkv.shape[0], heads, dv) or not out.is_contiguous():
        raise ValueError(f"qkv [T, 2 * {key_dim} + {heads} * {dv}], a and b [T, {heads}] alike, state [slots, "
                         f"heads, dk, dv] float32 and out [T, heads, dv] contiguous; got qkv {tuple(qkv.shape)}, "
                         f"a {tuple(a.shape)}, b {tuple(b.shape)}, state {tuple(state.shape)} {state.dtype}, out "
                         f"{tuple(out.shape)}")
    if slots.dtype != torch.int64 or query_start_loc.shape[0] != slots.shape[0] + 1:
        raise ValueError("slots must be int64 [S] and query_start_loc [S + 1]")
    if slots.shape[0] == 0:
        return
    grid = (slots.shape[0], heads, triton.cdiv(dv, BLOCK_V))
    _delta_rule_decode_kernel[grid](qkv, a, b, a_log, dt_bias, state, query_start_loc, slots, out, qkv.stride(0),
                                    a.stride(0), out.stride(0), state.stride(0), dk ** -0.5, eps,
                                    GROUP=heads // key_heads, KEY_DIM=key_dim, DK=dk, DV=dv,
                                    BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=BLOCK_V)
