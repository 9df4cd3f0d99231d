"""The causal depthwise conv of Qwen3-Next's linear-attention layers (models/gated_deltanet.py)
over a step's tokens, each sequence from the conv state in its slot, which it then advances:

    window   s0 s1 s2 | x0 x1 ... x(n-1)          (kernel 4: the state holds the last 3 inputs)
    y(t)     = silu(sum_j w[j] * window[t + j])    j = 0 .. kernel - 1
    state    = window[n:]                          the window's last kernel - 1

Program (s, tb, cb) takes tokens [tb * BLOCK_T, (tb + 1) * BLOCK_T) of sequence s and channels
[cb * BLOCK_C, (cb + 1) * BLOCK_C). Only a sequence's first token block reads its state (window
index t + j < kernel - 1 needs t < kernel - 1 <= BLOCK_T, or one block), and that program writes
the new state once its reads are done (a barrier between: another thread of the program may
hold the same state element), so no program reads a state that another writes. A decode step
is the case of one token a sequence. A sequence whose slot is -1 (a CUDA graph's padded row)
reads a zero state and writes none. Sequences and slots come from device tensors: a graph
replays it.

The sum is float32, rounded to the model dtype before the silu, as torch's conv1d then silu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 128
PREFILL_BLOCK_T = 32  # tokens a program of a prefill; a decode step's programs take one


@triton.jit(do_not_specialize=["starts_ptr", "slots_ptr"])
def _causal_conv_kernel(x_ptr, w_ptr, state_ptr, y_ptr, starts_ptr, slots_ptr, stride_x, stride_slot,
                        C: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    s = tl.program_id(0)
    tb = tl.program_id(1)
    start = tl.load(starts_ptr + s).to(tl.int64)
    n = tl.load(starts_ptr + s + 1).to(tl.int64) - start
    if tb * BLOCK_T < n:
        slot = tl.load(slots_ptr + s)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = t < n
        state = state_ptr + slot * stride_slot + c * (K - 1)  # channel c's state: K - 1 inputs, oldest first
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):
            p = t - (K - 1) + j  # the input's position in the sequence; < 0: in the state
            xv = tl.load(x_ptr + (start + p)[:, None] * stride_x + c[None, :],
                         mask=(rows & (p >= 0))[:, None] & cmask[None, :], other=0.0)
            sv = tl.load(state[None, :] + (p + K - 1)[:, None],
                         mask=(rows & (p < 0) & (slot >= 0))[:, None] & cmask[None, :], other=0.0)
            w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)
            acc += w.to(tl.float32)[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
        y = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.sigmoid(y)
        tl.store(y_ptr + (start + t)[:, None] * C + c[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=rows[:, None] & cmask[None, :])
        if (tb == 0) & (slot >= 0):
            i = tl.arange(0, BLOCK_K)  # the new state's column i: window[n + i]
            w_idx = n + i
            keep = (i < K - 1)[:, None] & cmask[None, :]
            inputs = tl.load(x_ptr + (start + w_idx - (K - 1))[:, None] * stride_x + c[None, :],
                             mask=(w_idx >= K - 1)[:, None] & keep, other=0.0)
            kept = tl.load(state[None, :] + w_idx[:, None], mask=(w_idx < K - 1)[:, None] & keep, other=0.0)
            new = tl.where((w_idx >= K - 1)[:, None], inputs, kept)
            tl.debug_barrier()  # every read of the old state above is done
            tl.store(state[None, :] + i[:, None], new, mask=keep)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                slots: torch.Tensor, max_query_len: int) -> torch.Tensor:
    """silu(causal conv) of x [T, C] (rows strided, channels contiguous) over each sequence's
    tokens (query_start_loc [S + 1] int32), from and into conv_state [slots, C, kernel - 1]
    (the model dtype, as x) at slots [S] int64 (-1: read zeros, write nothing); weight
    [C, 1, kernel] or [C, kernel]. `max_query_len`, the most tokens of a sequence (a host
    number), sizes the grid. Returns y [T, C] contiguous, x's dtype."""
    tokens, channels = x.shape
    kernel = weight.shape[-1]
    w = weight.reshape(channels, kernel)
    if x.stride(1) != 1 or not w.is_contiguous() or conv_state.shape[1:] != (channels, kernel - 1) \
            or not conv_state[0].is_contiguous() or conv_state.dtype != x.dtype:
        raise ValueError(f"x [T, C] with contiguous channels, weight [C, (1,) kernel] contiguous and conv_state "
                         f"[slots, C, kernel - 1] of x's dtype; got x {tuple(x.shape)} strides {x.stride()}, "
                         f"weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)} {conv_state.dtype}")
    if slots.dtype != torch.int64 or query_start_loc.shape[0] != slots.shape[0] + 1:
        raise ValueError("slots must be int64 [S] and query_start_loc [S + 1]")
    y = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    block_t = 1 if max_query_len == 1 else PREFILL_BLOCK_T
    if block_t < kernel - 1 < max_query_len:
        raise ValueError(f"a conv kernel of {kernel} taps needs BLOCK_T >= {kernel - 1}")
    grid = (slots.shape[0], triton.cdiv(max_query_len, block_t), triton.cdiv(channels, BLOCK_C))
    _causal_conv_kernel[grid](x, w, conv_state, y, query_start_loc, slots, x.stride(0), conv_state.stride(0),
                              C=channels, K=kernel, BLOCK_T=block_t, BLOCK_C=BLOCK_C,
                              BLOCK_K=triton.next_power_of_2(kernel - 1))
    return y
