"""The draft_model method of speculative decoding: a smaller model of the target's vocabulary
runs beside it in the same process, with a KV cache of its own over the target's block ids.

Its cache has one block for each of the target's (same block size, its own layers, heads and
dims), so the scheduler's block tables, slots, prefix-cache hits, forks and rollbacks serve both:
every step the draft runs the same tokens at the same positions as the target (`follow`), and
after the step's tokens are known it drafts K more for each decoding request, one batched
forward a position (`propose`; the runner's `draw` picks each draft from the logits: a draw
from q under the request's sampling parameters, or the argmax; without `draw` every draft is the
argmax, kept on the device until the last position), writing its KV into the blocks
the request holds (the scheduler reserves them beforehand, `reserve_lookahead`, where blocks are
free; without them the drafts stop where the request's last block ends). A rejected draft's KV
is overwritten when the position is computed again, in both caches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ember.config import EngineConfig
from ember.layers.attention import AttentionMetadata
from ember.layers.quant import model_weight_bytes
from ember.layers.quant.unquantized import cpu_packing_supported
from ember.layers.transfer import to_device
from ember.loader.model_files import load_model, locate_model
from ember.models.config import ModelConfig
from ember.request import Request
from ember.runner.cuda_graph import DecodeGraphs
from ember.runner.kv_heads import rank_kv_heads
from ember.scheduler.scheduler import SchedulerOutput

# a drafting step's pick: (logits [n, vocab] of its n requests, their indices in the requests
# drafted for) -> one draft each (the runner's: it samples and keeps the drafter's q)
DrawDrafts = Callable[[torch.Tensor, list[int]], list[int]]
# a draft position's ids, one a request drafting: drawn on the host, or argmaxes on the device
DraftIds = list[int] | torch.Tensor


def kept_rows(ids: DraftIds, keep: list[int], index: torch.Tensor) -> DraftIds:
    """The rows `keep` (on the device: `index`) of a position's ids."""
    return ids[index] if isinstance(ids, torch.Tensor) else [ids[j] for j in keep]


class Drafted:
    """A propose's drafts as its positions pick them: drawn on the host, or argmaxes left on the
    device (`draw` None) and read back together at the end, one wait for the device a propose."""

    def __init__(self, num_requests: int) -> None:
        self.drafts: list[list[int]] = [[] for _ in range(num_requests)]
        # (requests, their ids on the device: [n] one position, or [n, m] the next m positions, of which
        # request j keeps its first counts[j])
        self.on_device: list[tuple[list[int], torch.Tensor, list[int] | None]] = []

    def add(self, active: list[int], ids: DraftIds, counts: list[int] | None = None) -> None:
        if isinstance(ids, torch.Tensor):
            self.on_device.append((active, ids, counts))
        else:
            for i, t in zip(active, ids):
                self.drafts[i].append(t)

    def result(self) -> list[list[int]]:
        if self.on_device:
            ids = iter(torch.cat([t.reshape(-1) for _, t, _ in self.on_device]).tolist())
            for active, t, counts in self.on_device:
                if counts is None:
                    for i in active:
                        self.drafts[i].append(next(ids))
                    continue
                for i, count in zip(active, counts):
                    row = [next(ids) for _ in range(t.shape[1])]
                    self.drafts[i] += row[:count]
            self.on_device = []
        return self.drafts


class DraftCache:
    """A drafter's paged KV cache of its own, one block for each of the target's (same block
    size and ids; its own layers, heads and dims), so the scheduler's block tables serve it."""

    config: ModelConfig  # the drafter's layers
    model: nn.Module  # its attention_layers() read the cache
    block_size: int
    cache_dtype: torch.dtype
    device: torch.device
    drafts_without_kv = 0  # drafts a request gets past the end of the blocks it holds
    kv_cache: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        """This rank's: the drafter is sharded as the target is (tensor parallelism)."""
        return rank_kv_heads(self.config)

    def kv_bytes_per_block(self) -> int:
        mc = self.config
        return mc.kv_planes * mc.num_attention_layers * self.block_size * self.num_kv_heads * mc.cache_head_dim \
            * self.cache_dtype.itemsize

    def allocate_cache(self, num_blocks: int) -> None:
        """A cache of `num_blocks` blocks (the target pool's, its null block included)."""
        mc = self.config
        self.kv_cache = torch.zeros(mc.kv_planes, mc.num_attention_layers, num_blocks, self.block_size,
                                    self.num_kv_heads, mc.cache_head_dim, dtype=self.cache_dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[-1, i]

    def release(self, request_id: str) -> None:
        """A request left: what the drafter keeps for it goes."""


class DraftModel(DraftCache):
    def __init__(self, config: EngineConfig) -> None:
        spec = config.speculative_config
        self.config = spec.draft_model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.cache_dtype = config.kv_cache_torch_dtype
        self.model = load_model(locate_model(spec.model, "auto"), self.config, config.max_model_len,
                                config.torch_dtype, config.device, config.attention_backend, config.seed,
                                spec.draft_quantization)
        if self.device.type == "cpu" and cpu_packing_supported(config.torch_dtype):
            for module in self.model.modules():
                if hasattr(module, "pack_for_cpu"):
                    module.pack_for_cpu()
        self.weight_bytes = model_weight_bytes(self.model)
        self.graphs: DecodeGraphs | None = None  # its one-row-a-request steps, on CUDA

    def capture_graphs(self, max_rows: int, max_blocks_per_seq: int) -> None:
        """CUDA graphs of a step of one row a request at the decode batch sizes up to `max_rows` (after the cache
        exists), as the target's: each draft position of `propose`, and `follow` over a decode step
        or a verifying one (a token a row). Eager, a step with a 4-layer draft took 14.9 ms against a
        decode step's 0.87 at SmolLM2's size on an H100 (BENCHMARKS.md, 2026-12-06)."""
        self.graphs = DecodeGraphs(self.model, max_rows, max_blocks_per_seq, self.device)
        self.graphs.capture()

    @torch.inference_mode()
    def follow(self, plan: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               aux: torch.Tensor | None) -> None:
        """The step's tokens through the draft, for its KV at their positions: in its decode graphs
        where the step is a row a request or verifies drafts (a token a row, as the target's), else
        eagerly under its own plans (a backend's plan depends on the model's heads)."""
        if self.graphs is not None and positions.dim() == 1 \
                and self.graphs.replay_step(input_ids, positions, meta, plan.verifies_drafts) is not None:
            return
        self.model(input_ids, positions, dataclasses.replace(meta, plans={}))

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int], tables: list[np.ndarray],
                draw: DrawDrafts | None) -> list[list[int]]:
        """Up to limits[i] drafts for requests[i], whose last token (its KV not yet computed)
        starts them, each picked by `draw` (None: the argmax, fed to the next position on the
        device); `tables`: each request's block-table row."""
        drafted = Drafted(len(requests))
        positions = [r.num_computed_tokens for r in requests]
        bs = self.block_size
        active = [i for i, limit in enumerate(limits) if limit > 0]
        if not active:
            return drafted.result()
        token: DraftIds = [requests[i].all_token_ids[-1] for i in active]
        # the block tables go to the device once, not once a draft position (as the EAGLE-3 head's
        # do): a request that stops drafting drops its row on the device
        width = max(len(requests[i].block_ids) for i in active)
        table = to_device(np.stack([tables[i][:width] for i in active]), self.device)
        for step in range(max(limits[i] for i in active)):
            keep = [j for j, i in enumerate(active) if limits[i] > step]
            if len(keep) < len(active):
                index = to_device(keep, self.device, torch.int64)
                active, table, token = [active[j] for j in keep], table[index], kept_rows(token, keep, index)
            pos = [positions[i] + step for i in active]
            slots = [requests[i].block_ids[p // bs] * bs + p % bs for i, p in zip(active, pos)]
            n = len(active)
            host = token if isinstance(token, list) else []
            flat = to_device(host + pos + slots + [p + 1 for p in pos] + list(range(n + 1)), self.device, torch.int64)
            ids, pos_t, slot_t, lens, starts = flat.split([len(host), n, n, n, n + 1])
            if isinstance(token, torch.Tensor):
                ids = token
            if self.graphs is not None and n <= self.graphs.max_batch:
                hidden = self.graphs.run(ids, pos_t, slot_t, lens, table)
            else:
                meta = AttentionMetadata(
                    slot_mapping=slot_t, query_start_loc=starts.to(torch.int32), seq_lens=lens.to(torch.int32),
                    block_tables=table, query_lens_cpu=[1] * n, seq_lens_cpu=[p + 1 for p in pos])
                hidden = self.model(ids, pos_t, meta)
            logits = self.model.compute_logits(hidden)
            token = logits.argmax(dim=-1) if draw is None else draw(logits, active)
            drafted.add(active, token)
        return drafted.result()
