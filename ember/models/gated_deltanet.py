"""Gated DeltaNet: Qwen3-Next's linear-attention layer. No KV cache: each sequence carries a
fixed-size state from one token to the next, in a slot of its own (the runner's
runner/recurrent_state.py binds the slots; AttentionMetadata.state_slots says each sequence's).

Per token x (after the layer's input norm), with H value heads of dv dims and key heads of dk
(each key head serves H / key heads value heads, side by side):

    q | k | v, z = in_proj_qkvz(x)          b, a = in_proj_ba(x)
    q | k | v    = silu(causal depthwise conv over the last `kernel` tokens' q | k | v)
    q, k         = l2norm(q) / sqrt(dk), l2norm(k)           per head
    g            = -exp(A_log) * softplus(a + dt_bias)       the log of the state's decay, per head
    beta         = sigmoid(b)                                how much of the new value is written
    S            = exp(g) S                                  S: [dk, dv] per head
    S            = S + k (beta (v - k^T S))^T                the delta rule: write the error of S's guess
    o            = q^T S
    out          = out_proj(rmsnorm(o) * w * silu(z))        per head

The conv state is a sequence's last kernel - 1 inputs q | k | v (model dtype), the recurrent
state S of every head (float32). A decode step advances every sequence one token at once; a
prefill chunk runs its tokens one after the other from the state the previous chunk left (a
plain recurrence: exact, and fast enough for the prompt lengths run on the CPU).

The checkpoint's in_proj_qkvz / in_proj_ba rows come grouped by key head; the loader reorders
them part by part (loader/weights.linear_rows_by_part), so each part is one slice here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel_state import tp_size
from ember.layers.attention import AttentionMetadata
from ember.layers.linear import Linear
from ember.models.config import ModelConfig

L2NORM_EPS = 1e-6  # transformers' (and the fla library's) eps inside the q / k norms


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(gate) over each head's dv dims; w as the checkpoint holds it (no 1 + w)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences: state [S, H, dk, dv] (updated in place), q, k [S, H, dk],
    v [S, H, dv], g, beta [S, H], all float32 -> o [S, H, dv]."""
    state.mul_(g.exp()[..., None, None])
    error = v - torch.einsum("shk,shkv->shv", k, state)
    state.add_(k[..., None] * (beta[..., None] * error)[..., None, :])
    return torch.einsum("shk,shkv->shv", q, state)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if tp_size() > 1:
            raise ValueError("tensor parallelism does not split the gated DeltaNet layers yet: run the model with "
                             "tensor_parallel_size 1")
        h = cfg.hidden_size
        self.key_heads, self.heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.key_heads * self.dk, self.heads * self.dv
        self.conv_dim, self.kernel = cfg.linear_conv_dim, cfg.linear_conv_kernel
        self.in_proj_qkvz = Linear(h, self.conv_dim + self.value_dim)
        self.in_proj_ba = Linear(h, 2 * self.heads)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h)
        # bound by the runner (runner/recurrent_state.py): [slots, conv_dim, kernel - 1] in the
        # model dtype and [slots, heads, dk, dv] float32
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A slot's conv state and recurrent state."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.dk, self.dv)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the normed hidden states [T, hidden] -> [T, hidden]."""
        tokens, dtype = x.shape[0], x.dtype
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).split([self.heads, self.heads], dim=-1)
        decode = meta.num_seqs == tokens  # one token a sequence: every sequence steps at once
        qkv = self._conv(qkv, meta, decode)
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        group = self.heads // self.key_heads
        q = _l2norm(q.view(tokens, self.key_heads, self.dk)).repeat_interleave(group, dim=1) * self.dk ** -0.5
        k = _l2norm(k.view(tokens, self.key_heads, self.dk)).repeat_interleave(group, dim=1)
        v = v.view(tokens, self.heads, self.dv)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if decode:
            slots = meta.state_slots
            state = self.recurrent_state[slots]
            o = delta_rule_step(state, q, k, v, g, beta)
            self.recurrent_state[slots] = state
        else:
            o = torch.empty_like(v)
            for slot, start, stop in _sequences(meta):
                state = self.recurrent_state[slot:slot + 1]  # a view: updated in place
                for t in range(start, stop):
                    o[t:t + 1] = delta_rule_step(state, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                 beta[t:t + 1])
        o = self.norm(o.to(dtype), z.view(tokens, self.heads, self.dv))
        return self.out_proj(o.reshape(tokens, self.value_dim))

    def _conv(self, x: torch.Tensor, meta: AttentionMetadata, decode: bool) -> torch.Tensor:
        """silu of the causal depthwise convolution of x [T, conv_dim] over each sequence's tokens,
        the kernel - 1 before its first ones from its conv state (which then keeps its last ones).

            window   s0 s1 s2 | x0 x1 ... x(n-1)      (kernel 4: three from the state)
            y(i)     = sum_j w[j] * window[i + j]      j = 0 .. kernel - 1
        """
        weight = self.conv1d.weight  # [conv_dim, 1, kernel]
        if decode:
            slots = meta.state_slots
            window = torch.cat([self.conv_state[slots], x[:, :, None]], dim=-1)  # [S, conv_dim, kernel]
            self.conv_state[slots] = window[..., 1:]
            return F.silu((window * weight[:, 0]).sum(-1))
        y = torch.empty_like(x)
        for slot, start, stop in _sequences(meta):
            window = torch.cat([self.conv_state[slot], x[start:stop].t()], dim=-1)  # [conv_dim, kernel - 1 + n]
            self.conv_state[slot] = window[:, window.shape[1] - (self.kernel - 1):]
            y[start:stop] = F.conv1d(window[None], weight, groups=self.conv_dim)[0].t()
        return F.silu(y)


def _sequences(meta: AttentionMetadata):
    """(state slot, first row, end row) of each sequence of the step."""
    start = 0
    for slot, n in zip(meta.state_slots_cpu, meta.query_lens_cpu):
        yield slot, start, start + n
        start += n
