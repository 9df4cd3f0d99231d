"""CUDA graphs. Decode steps (DecodeGraphs): the whole forward (every layer's kernels)
replayed with one launch, at padded batch sizes 1, 2, 4, 8, 16, 24, ..., 256, then every
32, up to max_num_seqs.

Mixed and prefill steps of up to `mixed_graph_max_tokens` tokens (PiecewiseGraphs): the
forward cut at each layer's attention, as vLLM's piecewise graphs are. The pieces between
attentions (norms, projections, RoPE and the KV write, the MLP) replay as graphs at padded
token counts; attention runs eagerly between them on static buffers, since its grid follows
the step's sequences. A mixed step otherwise launches ~12 kernels a layer from Python, which
on the H200 took 19-33 ms of wall for 13 ms of GPU work at the Llama-8B shape.

A graph reads its inputs from static buffers that each step fills:

    rows          0 ........ n-1 | n ........ bs-1      (bs: the smallest captured size >= n)
    input_ids     this step's    | stale (harmless)
    slot_mapping  this step's    | -1: the KV write skips the row
    seq_lens      this step's    | 0: attention reads nothing, outputs 0
    block_tables  [:n, :width]   | stale (never read: seq_len 0)
    state_slots   this step's    | -1: a linear-attention layer reads a zero state, writes none
                                   (models with recurrent state only: runner/recurrent_state.py)

Graphs share one memory pool, captured largest first so the smaller ones reuse it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ember.layers.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, min(max_num_seqs, 256), 8))
    sizes += list(range(256, max_num_seqs, 32))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 state_slots: bool = False) -> None:
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.state_slots = torch.full((n,), -1, dtype=torch.int64, device=device) if state_slots else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                 seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                 query_lens_cpu=[1] * bs, seq_lens_cpu=[1] * bs)
        if self.state_slots is not None:  # on the device only: the layers' CUDA path reads no host slot
            meta.state_slots = self.state_slots[:bs]
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.model(*args)  # compiles any Triton kernel this size needs, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.2f s, %.1f MiB", len(self.sizes),
                    self.sizes[0], self.max_batch, self.capture_seconds, self.pool_bytes / 2**20)

    def padded_size(self, n: int) -> int | None:
        for bs in self.sizes:
            if bs >= n:
                return bs
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, state_slots: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for n = len(input_ids) sequences (device tensors); hidden [n, hidden].
        `state_slots`: each sequence's recurrent-state slot, for a model that has them."""
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(0)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(state_slots)
            self.state_slots[n:bs].fill_(-1)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


    def replay_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    verifies_drafts: bool) -> torch.Tensor | None:
        """A step's hidden states from these graphs where it fits them: a row a sequence, or a step
        verifying drafts as a token a row (AttentionMetadata.as_decode_rows); None where it does
        not (the caller runs it another way)."""
        n = len(input_ids)
        if n > self.max_batch:
            return None
        if n == meta.num_seqs:
            return self.run(input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables,
                            meta.state_slots)
        if verifies_drafts:
            rows = meta.as_decode_rows()
            return self.run(input_ids, positions, rows.slot_mapping, rows.seq_lens, rows.block_tables)
        return None


def piecewise_token_counts(max_tokens: int) -> list[int]:
    """16, 32, 48, 64, then every 32 to 256, then every 64: a step pads to the next one."""
    sizes = list(range(16, 64, 16)) + list(range(64, 256, 32)) + list(range(256, max_tokens, 64))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens}) if max_tokens > 0 else []


class _AttentionCall:
    """One layer's attention as the capture met it: the real backend and the layer's options."""

    def __init__(self, backend: AttentionBackend, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 options: dict) -> None:
        self.backend, self.k_cache, self.v_cache, self.scale, self.options = backend, k_cache, v_cache, scale, options


class _Cut(AttentionBackend):
    """Stands in for every layer's backend while the pieces are captured: it copies q (and
    k, v where the RoPE kernel has not stored them) into the static buffers, ends the piece's
    capture, starts the next one, and hands back the static attention output."""

    name = "piecewise-cut"

    def __init__(self, owner: PiecewiseGraphs, real: list[AttentionBackend]) -> None:
        self.owner, self.real, self.layer = owner, real, 0
        self.capturing = False
        self.pieces: list[torch.cuda.CUDAGraph] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self.owner.pool)
        self.pieces.append(graph)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, kv_written=False,
                sliding_window=None, logit_softcap=None, sinks=None, attention_chunk=None, value_dim=None):
        o = self.owner
        n = q.shape[0]
        o.q[:n].copy_(q)
        if not kv_written:
            o.k[:n].copy_(k)
            o.v[:n].copy_(v)
        if len(o.calls) <= self.layer:
            o.calls.append(_AttentionCall(self.real[self.layer], k_cache, v_cache, scale, dict(
                k_scale=k_scale, v_scale=v_scale, kv_written=kv_written, sliding_window=sliding_window,
                logit_softcap=logit_softcap, sinks=sinks, attention_chunk=attention_chunk, value_dim=value_dim)))
        self.layer += 1
        if self.capturing:
            self.pieces[-1].capture_end()
            self.begin()
        return o.out[:n, :, :value_dim]  # MLA: the latent dims (base.py); None: all


class PiecewiseGraphs:
    """Mixed and prefill steps of up to max_tokens tokens as graphs between eager attentions.

    Static buffers, rows 0 .. T-1 this step's tokens, T .. S-1 padding (S: the next captured
    count): input_ids and positions stale there (harmless rows), slot_mapping -1 (no KV
    write); q / k / v / out hold one layer at a time (every layer's piece writes them)."""

    def __init__(self, model: nn.Module, max_tokens: int, dtype: torch.dtype, device: torch.device, pool) -> None:
        self.model = model
        self.sizes = piecewise_token_counts(max_tokens)
        self.max_tokens = self.sizes[-1]
        n = self.max_tokens
        attn = model.attention_layers()[0]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.out = torch.zeros_like(self.q)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.calls: list[_AttentionCall] = []
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def _meta(self, n: int) -> AttentionMetadata:
        zeros = torch.zeros(1, dtype=torch.int32, device=self.input_ids.device)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:n], query_start_loc=zeros, seq_lens=zeros,
                                 block_tables=zeros.view(1, 1), query_lens_cpu=[n], seq_lens_cpu=[n])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        layers = self.model.attention_layers()
        cut = _Cut(self, [layer.backend for layer in layers])
        for layer in layers:
            layer.backend = cut
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            for n in reversed(self.sizes):
                args = (self.input_ids[:n], self.positions[:n], self._meta(n))
                cut.layer, cut.capturing = 0, False
                self.model(*args)  # compiles what this size needs, outside the capture
                torch.cuda.synchronize()
                cut.layer, cut.capturing, cut.pieces = 0, True, []
                with torch.cuda.stream(stream):
                    cut.begin()
                    self.outputs[n] = self.model(*args)
                    cut.pieces[-1].capture_end()
                self.pieces[n] = cut.pieces
            torch.cuda.synchronize()
        finally:
            for layer, real in zip(layers, cut.real):
                layer.backend = real
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.info("captured piecewise CUDA graphs for steps of %d..%d tokens (%d pieces each) in %.2f s, %.1f MiB",
                    self.sizes[0], self.max_tokens, len(self.calls) + 1, self.capture_seconds, self.pool_bytes / 2**20)

    def padded_size(self, n: int) -> int | None:
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One step of n = len(input_ids) <= max_tokens tokens (device tensors); hidden [n, hidden]."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        q, k, v, out = self.q[:n], self.k[:n], self.v[:n], self.out[:n]
        pieces = self.pieces[size]
        for piece, call in zip(pieces, self.calls):
            piece.replay()
            o = call.backend.forward(q, k, v, call.k_cache, call.v_cache, meta, call.scale, **call.options)
            out[..., :o.shape[-1]].copy_(o)  # MLA's output: the first value_dim dims of the buffer
        pieces[-1].replay()
        return self.outputs[size][:n]
