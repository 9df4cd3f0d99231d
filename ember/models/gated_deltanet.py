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
state S of every head (float32). On the CPU (plain torch) a decode step advances every
sequence one token at once (`delta_rule_step`); a prefill chunk runs from the state the previous
chunk left, DELTA_CHUNK tokens at a time in matrix products (`delta_rule_chunked`), each
sequence of the step in turn. On CUDA (`_kernels`) Triton kernels do the same without a host
sync: the conv for every sequence of the step, a fused step for the one-token ones, and for the
longer ones every chunk's `chunk_terms` at once (padded chunks, `_Chunks`), then a kernel that
carries each sequence's state through its chunks; a decode step replays as a CUDA graph.

The checkpoint's in_proj_qkvz / in_proj_ba rows come grouped by key head; the loader reorders
them part by part (loader/weights.linear_rows_by_part), so each part is one slice here, and
in_proj_qkvz's shards are q, k, v and z (a GGUF holds q | k | v and z so already, as two
tensors: the loader cuts the first into its three). Under tensor parallelism each rank takes
its key heads' rows of each part (`GatedDeltaNet`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel_state import tp_rank, tp_size
from ember.distributed.sharding import split_evenly
from ember.layers.attention import AttentionMetadata
from ember.layers.kernel_paths import cuda_paths
from ember.layers.linear import MergedLinear, RowParallelLinear
from ember.layers.transfer import to_device
from ember.models.config import ModelConfig

L2NORM_EPS = 1e-6  # transformers' (and the fla library's) eps inside the q / k norms
DELTA_CHUNK = 64  # tokens a prefill advances the state by at once (transformers' chunk_size)


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


class ChunkTerms(NamedTuple):
    """What a chunk of c tokens contributes, whatever the state it starts from (`chunk_terms`);
    leading dims [...] (heads, or chunks and heads) as the inputs'."""

    wk: torch.Tensor  # [..., c, dk]  (I + A)^-1 beta exp(G) K
    wv: torch.Tensor  # [..., c, dv]  (I + A)^-1 beta V
    qg: torch.Tensor  # [..., c, dk]  exp(G) Q
    p: torch.Tensor  # [..., c, c]    QK^T * D, i <= t
    kd: torch.Tensor  # [..., c, dk]  D(c, i) K: each key decayed to the chunk's end
    decay: torch.Tensor  # [...]      exp(G(c)): the state's decay over the chunk


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> ChunkTerms:
    """One chunk's terms (see `delta_rule_chunked`): q, k [..., c, dk], v [..., c, dv], g, beta
    [..., c], float32. Rows of g = beta = 0 and zero k past a chunk's last token (padding) leave
    its state's update as it is."""
    cum = g.cumsum(-1)  # G [..., c]
    causal = torch.ones(cum.shape[-1], cum.shape[-1], dtype=torch.bool, device=cum.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # D [..., c, c]
    kt = k.transpose(-1, -2)
    a = (beta[..., None] * (k @ kt) * decay).tril(-1)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    eye = torch.eye(a.shape[-1], device=a.device)
    w = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    last = cum[..., -1:]
    return ChunkTerms(w[..., v.shape[-1]:], w[..., :v.shape[-1]], q * cum.exp()[..., None], (q @ kt) * decay,
                      k * (last - cum).exp()[..., None], last[..., 0].exp())


def delta_rule_chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """n tokens of one sequence, as n `delta_rule_step`s: state [H, dk, dv] (updated in place),
    q, k [n, H, dk], v [n, H, dv], g, beta [n, H], all float32 -> o [n, H, dv].

    Within a chunk from state S0, with G(t) = g(1) + ... + g(t) and D(t, i) = exp(G(t) - G(i)):

        S(t) = exp(G(t)) S0 + sum_{i <= t} D(t, i) k(i) u(i)^T
        u(t) = beta(t) (v(t) - exp(G(t)) k(t)^T S0) - sum_{i < t} beta(t) D(t, i) (k(t).k(i)) u(i)

    so (I + A) U = beta V - beta exp(G) K S0 with A strictly lower triangular, one triangular
    solve for [beta V | beta exp(G) K] (`chunk_terms`: all that does not depend on S0); then
    U = Wv - Wk S0, O = exp(G) Q S0 + (QK^T * D, i <= t) U and the chunk's last state
    exp(G(c)) S0 + (D(c, i) K)^T U. No exp of a positive number: D is taken where i <= t only.
    (On CUDA the terms of every chunk of a step come at once, kernels/delta_rule_chunk.py
    carries the state through them.)"""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, n, d]
    g, beta = g.t(), beta.t()  # [H, n]
    out = []
    for start in range(0, q.shape[1], chunk):
        rows = slice(start, start + chunk)
        t = chunk_terms(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows])
        u = t.wv - t.wk @ state  # [H, c, dv]
        out.append(t.qg @ state + t.p @ u)
        state.mul_(t.decay[:, None, None]).add_(t.kd.transpose(1, 2) @ u)
    return torch.cat(out, dim=1).transpose(0, 1)


class GatedDeltaNet(nn.Module):
    """Tensor parallelism (vLLM's split): the key heads divide evenly among the ranks, each with
    the value heads it serves, so a rank holds its heads' rows of q, k, v and z (in_proj_qkvz's
    four shards), of b and a, their conv channels, dt_bias and A_log, and out_proj's columns of
    its value heads (row-parallel: one all-reduce); the gated norm's weight (per dv) is whole on
    every rank. Everything below sees this rank's heads alone, in the layout of one process
    (q | k | v contiguous), and so do the kernels and the state slots."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        group = cfg.linear_num_value_heads // cfg.linear_num_key_heads  # value heads a key head serves
        first_key, self.key_heads = split_evenly(cfg.linear_num_key_heads, tp_rank(), tp_size(),
                                                 "the gated DeltaNet's key heads (linear_num_key_heads)")
        self.first_head, self.heads = first_key * group, self.key_heads * group  # this rank's value heads
        self.dk, self.dv = dk, dv
        self.key_dim, self.value_dim = self.key_heads * dk, self.heads * dv
        self.conv_dim, self.kernel = 2 * self.key_dim + self.value_dim, cfg.linear_conv_kernel
        keys, values = cfg.linear_num_key_heads * dk, cfg.linear_num_value_heads * dv
        key_rows, value_rows = (first_key * dk, self.key_dim), (self.first_head * dv, self.value_dim)
        self.in_proj_qkvz = MergedLinear(h, [keys, keys, values, values],
                                         rows=[key_rows, key_rows, value_rows, value_rows])  # q, k, v, z
        self.in_proj_ba = MergedLinear(h, [cfg.linear_num_value_heads] * 2, rows=[(self.first_head, self.heads)] * 2)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.dt_bias.weight_loader = self.A_log.weight_loader = self._load_heads
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(values, h, what="the gated DeltaNet's value heads")
        # bound by the runner (runner/recurrent_state.py): [slots, conv_dim, kernel - 1] in the
        # model dtype and [slots, heads, dk, dv] float32, this rank's heads
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """The checkpoint's conv channels q | k | v, this rank's of each."""
        full = self.in_proj_qkvz.full_sizes[:3]
        if tuple(loaded.shape) != (sum(full), *param.shape[1:]):
            raise ValueError(f"parameter {(sum(full), *param.shape[1:])}, checkpoint {tuple(loaded.shape)}")
        parts = loaded.split(full)
        param.data.copy_(torch.cat([p.narrow(0, *rows) for p, rows in zip(parts, self.in_proj_qkvz.rank_rows)]))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard: None = None) -> None:
        """dt_bias or A_log: this rank's value heads' entries."""
        if loaded.dim() != 1 or loaded.shape[0] != self.in_proj_ba.full_sizes[0]:
            raise ValueError(f"parameter ({self.in_proj_ba.full_sizes[0]},), checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.first_head, self.heads))

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A slot's conv state and recurrent state."""
        return (self.conv_dim, self.kernel - 1), (self.heads, self.dk, self.dv)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the normed hidden states [T, hidden] -> [T, hidden]."""
        tokens, dtype = x.shape[0], x.dtype
        qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba.split(self.in_proj_ba(x))
        o = self._kernels(qkv, a, b, meta) if cuda_paths(x) else self._torch(qkv, a, b, meta)
        o = self.norm(o.to(dtype), z.view(tokens, self.heads, self.dv))
        return self.out_proj(o.reshape(tokens, self.value_dim))

    def _inputs(self, qkv: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [T, H, dk] (each key head repeated for its value heads), v [T, H, dv], g, beta [T, H],
        float32, from the conv's output."""
        tokens = qkv.shape[0]
        q, k, v = qkv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        group = self.heads // self.key_heads
        q = _l2norm(q.view(tokens, self.key_heads, self.dk)).repeat_interleave(group, dim=1) * self.dk ** -0.5
        k = _l2norm(k.view(tokens, self.key_heads, self.dk)).repeat_interleave(group, dim=1)
        v = v.view(tokens, self.heads, self.dv)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, beta

    def _torch(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The CPU's path (and the kernels' reference): o [T, H, dv] float32."""
        decode = meta.num_seqs == qkv.shape[0]  # one token a sequence: every sequence steps at once
        q, k, v, g, beta = self._inputs(self._conv(qkv, meta, decode), a, b)
        if decode:
            slots = meta.state_slots
            state = self.recurrent_state[slots]
            o = delta_rule_step(state, q, k, v, g, beta)
            self.recurrent_state[slots] = state
            return o
        o = torch.empty_like(v)
        for slot, start, stop in _sequences(meta):
            rows = slice(start, stop)
            if stop - start == 1:  # a decode row of a mixed step
                o[rows] = delta_rule_step(self.recurrent_state[slot:slot + 1], q[rows], k[rows], v[rows], g[rows],
                                          beta[rows])
            else:
                o[rows] = delta_rule_chunked(self.recurrent_state[slot], q[rows], k[rows], v[rows], g[rows],
                                             beta[rows])
        return o

    def _kernels(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """CUDA's path: o [T, H, dv] in the model dtype. The conv over every sequence and the
        delta rule of the one-token ones are Triton kernels that read the slots and lengths on
        the device (a decode step is those two alone: its CUDA graph replays them); the longer
        sequences' chunks get their terms in batched matrix products, all at once, and a kernel
        carries each one's state through them. Nothing waits for the device."""
        from ember.kernels.causal_conv import causal_conv
        from ember.kernels.delta_rule_decode import delta_rule_decode

        lens = meta.query_lens_cpu
        y = causal_conv(qkv, self.conv1d.weight, self.conv_state, meta.query_start_loc, meta.state_slots, max(lens))
        o = torch.empty(y.shape[0], self.heads, self.dv, dtype=y.dtype, device=y.device)
        if min(lens) == 1:
            delta_rule_decode(y, a, b, self.A_log, self.dt_bias, self.recurrent_state, meta.query_start_loc,
                              meta.state_slots, o, self.key_heads, L2NORM_EPS)
        if max(lens) > 1:
            self._chunked(y, a, b, meta, o)
        return o

    def _chunked(self, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata,
                 o: torch.Tensor) -> None:
        """The rows of `o` of the step's sequences of more than one token."""
        from ember.kernels.delta_rule_chunk import delta_rule_chunk_pass

        chunks = meta.plans.get(_Chunks.KEY)
        if chunks is None:  # once a step, for every layer
            chunks = meta.plans[_Chunks.KEY] = _Chunks.of(meta, y.device)
        terms = chunk_terms(*(chunks.pad(x) for x in self._inputs(y, a, b)))
        out = delta_rule_chunk_pass(*(x.contiguous() for x in terms), self.recurrent_state, chunks.chunk_starts,
                                    chunks.slots)
        o[chunks.tokens] = out.transpose(1, 2).reshape(-1, self.heads, self.dv)[chunks.rows].to(o.dtype)

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


class _Chunks:
    """A step's sequences of more than one token cut into DELTA_CHUNK-token chunks, each
    sequence's from its first token, the last one padded (one-token sequences take the decode
    kernel; chunk size 4 drawn):

        tokens   a0 a1 a2 a3 a4 a5 | b0 | c0 c1             (query_start_loc)
        chunks   [a0 a1 a2 a3] [a4 a5 -- --] [c0 c1 -- --]   -- : padding, a zero row
        gather   0 1 2 3 4 5 9 9 7 8 9 9                     T = 9: the zero row
        rows     0 1 2 3 4 5 8 9                             (tokens 0 1 2 3 4 5 7 8)
        chunk_starts  0 2 3       slots  slot of a, slot of c
    """

    KEY = "gated_deltanet_chunks"  # in AttentionMetadata.plans

    def __init__(self, gather: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, chunk_starts: torch.Tensor,
                 slots: torch.Tensor) -> None:
        self.gather = gather  # [chunks * DELTA_CHUNK] int64: the token of each padded row (T: the zero row)
        self.tokens = tokens  # [N] int64: the chunked sequences' tokens
        self.rows = rows  # [N] int64: each one's padded row
        self.chunk_starts = chunk_starts  # [S' + 1] int32: sequence i's chunks
        self.slots = slots  # [S'] int64: their state slots

    @staticmethod
    def of(meta: AttentionMetadata, device: torch.device) -> _Chunks:
        lens = np.array(meta.query_lens_cpu)
        starts = np.concatenate([[0], np.cumsum(lens)])
        seqs = np.flatnonzero(lens > 1)
        per_seq = -(-lens[seqs] // DELTA_CHUNK)
        chunk_starts = np.concatenate([[0], np.cumsum(per_seq)])
        owner = np.repeat(np.arange(len(seqs)), per_seq)  # each chunk's sequence, of seqs
        first = starts[seqs][owner] + (np.arange(chunk_starts[-1]) - chunk_starts[owner]) * DELTA_CHUNK
        token = first[:, None] + np.arange(DELTA_CHUNK)
        valid = token < starts[seqs + 1][owner][:, None]
        gather = np.where(valid, token, starts[-1]).reshape(-1)
        rows = np.flatnonzero(valid)
        flat = to_device(np.concatenate([gather, gather[rows], rows, chunk_starts, seqs]).astype(np.int64), device)
        gather, tokens, rows, chunk_starts, seqs = flat.split(
            [len(gather), len(rows), len(rows), len(chunk_starts), len(seqs)])
        return _Chunks(gather, tokens, rows, chunk_starts.to(torch.int32), meta.state_slots[seqs])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, ...] -> [chunks, H, DELTA_CHUNK, ...], zero past each sequence's end."""
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.gather]
        return padded.view(-1, DELTA_CHUNK, *x.shape[1:]).transpose(1, 2)


def _sequences(meta: AttentionMetadata) -> Iterator[tuple[int, int, int]]:
    """(state slot, first row, end row) of each sequence of the step."""
    start = 0
    for slot, n in zip(meta.state_slots_cpu, meta.query_lens_cpu):
        yield slot, start, start + n
        start += n
