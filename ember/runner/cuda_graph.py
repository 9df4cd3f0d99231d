"""CUDA graphs for decode steps: the whole forward (every layer's kernels) replayed with
one launch, at padded batch sizes 1, 2, 4, 8, 16, 24, ..., 256, then every 32, up to
max_num_seqs.

A graph reads its inputs from static buffers that each step fills:

    rows          0 ........ n-1 | n ........ bs-1      (bs: the smallest captured size >= n)
    input_ids     this step's    | stale (harmless)
    slot_mapping  this step's    | -1: the KV write skips the row
    seq_lens      this step's    | 0: attention reads nothing, outputs 0
    block_tables  [:n, :width]   | stale (never read: seq_len 0)

Graphs share one memory pool, captured largest first so the smaller ones reuse it.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ember.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, min(max_num_seqs, 256), 8))
    sizes += list(range(256, max_num_seqs, 32))
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
                                 seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
                                 query_lens_cpu=[1] * bs, seq_lens_cpu=[1] * bs)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
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
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One decode step for n = len(input_ids) sequences (device tensors); hidden [n, hidden]."""
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:bs].fill_(0)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
