"""CUDA graphs of the vision towers (CUDA only; the CPU and --enforce-eager run them eagerly).
A tower call launches a few kernels per block for ~30 blocks (Qwen2.5-VL-7B's tower over one
1024 x 768 image: ~1,500 launches); a graph replays them with one.

Packed towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `plan(grids)` and `run(patches, plan)`): a graph
a step's exact grids (and dtype), since every shape and the plan's tensors (RoPE, segments,
window rows) follow them. GraphLRU decides: the first sight of a key runs eagerly, the second
captures it (a warm-up run outside the capture for Triton's compiles, then the capture over a
static patches buffer; the entry keeps the plan alive), later ones replay. At most
TOWER_GRAPH_ENTRIES entries and `max_bytes` of their static buffers (patches and outputs), the
least recently used dropped first; steps of more than `max_tokens` image tokens run eagerly.

Fixed-shape towers (LLaVA's CLIP, Gemma 3's SigLIP: every image at the config's image_size):
captured at start-up at batch sizes 1, 2, 4, ... up to the most images `max_tokens` holds, a
batch padded to the next size (images do not see each other: the padding rows are harmless).

Memory: the graphs have one pool of their own (a replay never overlaps another: one stream).
The fixed-shape graphs are captured before the KV pool is sized, which then sees them as used;
for the packed ones the runner keeps `reserve` bytes out of the KV pool from the start: the
peak of one eager call at `max_tokens` (what the largest capture's pool needs) plus `max_bytes`.
Once the pool (measured after each capture) and the static buffers pass the reserve, no
further key is captured."""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

import torch
from torch import nn

from ember.runner.cuda_graph import graph_batch_sizes

logger = logging.getLogger(__name__)

TOWER_GRAPH_ENTRIES = 8  # packed towers: captured grid keys kept
TOWER_GRAPH_MAX_TOKENS = 4096  # image tokens of the largest captured call: past it the GPU's work dwarfs the launches


class GraphLRU:
    """Which tower calls a packed tower's graph cache captures and replays, by key: eager the
    first time a key is seen, captured the second time, replayed after; at most `max_entries`
    captured keys and `max_bytes` of their static buffers, the least recently used evicted
    first. A key whose buffers alone pass `max_bytes` always runs eagerly. The keys seen once are
    remembered, the last `max_seen` of them."""

    def __init__(self, max_entries: int, max_bytes: int, max_seen: int = 64) -> None:
        self.max_entries, self.max_bytes, self.max_seen = max_entries, max_bytes, max_seen
        self.captured: OrderedDict[Hashable, int] = OrderedDict()  # key -> its static buffers' bytes
        self.seen: OrderedDict[Hashable, None] = OrderedDict()
        self.nbytes = 0

    def decide(self, key: Hashable, nbytes: int) -> tuple[str, list[Hashable]]:
        """("eager" | "capture" | "replay", the captured keys to drop first)."""
        if key in self.captured:
            self.captured.move_to_end(key)
            return "replay", []
        if key not in self.seen or nbytes > self.max_bytes:
            self.seen[key] = None
            self.seen.move_to_end(key)
            if len(self.seen) > self.max_seen:
                self.seen.popitem(last=False)
            return "eager", []
        del self.seen[key]
        evicted = []
        while self.captured and (len(self.captured) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            old, size = self.captured.popitem(last=False)
            self.nbytes -= size
            evicted.append(old)
        self.captured[key] = nbytes
        self.nbytes += nbytes
        return "capture", evicted

@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    patches: torch.Tensor  # the static input the graph reads
    plan: object  # the TowerPlan whose tensors the graph reads (kept alive here)
    outputs: list[torch.Tensor]  # each image's rows in the graph's memory (read before the next replay)


class PackedTowerGraphs:
    """A packed tower's calls by grid key: eager, captured or replayed (the module's note)."""

    def __init__(self, vision: nn.Module, max_tokens: int, max_bytes: int, reserve: int,
                 max_entries: int = TOWER_GRAPH_ENTRIES) -> None:
        self.vision = vision
        self.max_tokens = max_tokens
        self.reserve = reserve  # bytes the pool may grow to
        self.policy = GraphLRU(max_entries, max_bytes)
        self.entries: dict[Hashable, _Entry] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.pool_bytes = 0  # the pool's size, measured after each capture
        self.failed = False  # a capture raised: every call runs eagerly from then on
        self.unit = vision.config.merge_size ** 2
        self.row_bytes = vision.config.text_hidden_size * (1 + getattr(vision, "deepstack_layers", 0))

    @torch.inference_mode()
    def __call__(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> tuple[list[torch.Tensor], bool]:
        """Each image's embeddings (views into the graph's memory when replayed: copy them before
        the next call) and whether a graph ran."""
        grids = [tuple(int(v) for v in g) for g in grids]
        key = (tuple(grids), patches.dtype)
        tokens = sum(math.prod(g) for g in grids) // self.unit
        action = "eager"
        full = self.pool_bytes + self.policy.nbytes > self.reserve  # captures stop; what is captured replays
        if not self.failed and tokens <= self.max_tokens and (key in self.entries or not full):
            action, evicted = self.policy.decide(key, patches.nbytes + tokens * self.row_bytes * patches.element_size())
            for old in evicted:
                del self.entries[old]
        if action == "capture":
            try:
                self._capture(key, patches, grids)
            except Exception as e:  # a graph is an optimization: its failure must not fail the step's requests
                logger.warning("capturing the vision tower's CUDA graph for grids %s failed (%s: %s): the tower runs "
                               "eagerly from now on", grids, type(e).__name__, e)
                self.failed, self.entries, action = True, {}, "eager"
        if action == "eager":
            return self.vision(patches, grids), False
        entry = self.entries[key]
        entry.patches.copy_(patches)
        entry.graph.replay()
        return entry.outputs, True

    def _capture(self, key: Hashable, patches: torch.Tensor, grids: list) -> None:
        start = time.perf_counter()
        plan = self.vision.plan(grids, patches.device)
        static = patches.clone()
        self.vision.run(static, plan)  # Triton's compiles for these shapes, outside the capture
        graph = torch.cuda.CUDAGraph()
        # thread_local: the host tier's buffers may be allocated by another thread meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self.vision.run(static, plan)
        self.entries[key] = _Entry(graph, static, plan, outputs)
        self.pool_bytes = graph_pool_bytes(self.pool)
        logger.info("captured a vision tower CUDA graph for grids %s in %.2f s (their pool %.1f MiB, static "
                    "buffers %.1f MiB)", grids, time.perf_counter() - start, self.pool_bytes / 2**20,
                    self.policy.nbytes / 2**20)
        if self.pool_bytes + self.policy.nbytes > self.reserve:
            logger.warning("the vision tower graphs' memory (%.1f MiB) passed its reserve (%.1f MiB): no further "
                           "grids are captured", (self.pool_bytes + self.policy.nbytes) / 2**20, self.reserve / 2**20)


def graph_pool_bytes(pool: tuple) -> int:
    """Bytes the allocator holds in a graph memory pool."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool))


class FixedTowerGraphs:
    """A fixed-shape tower ([B, C, H, W] -> [B, tokens, hidden]) captured at batch sizes 1, 2, 4,
    ... up to `max_batch` (graph_batch_sizes), largest first into one pool."""

    def __init__(self, vision: nn.Module, pixel_shape: tuple[int, ...], max_batch: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.vision = vision
        self.pixel_shape = tuple(pixel_shape)
        self.sizes = graph_batch_sizes(max_batch)
        self.pixels = torch.zeros(self.sizes[-1], *pixel_shape, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self.vision(self.pixels[:bs])  # Triton's compiles for this size, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.vision(self.pixels[:bs])
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_reserved() - before
        logger.info("captured vision tower CUDA graphs (batch %d..%d of %s) in %.2f s, %.1f MiB", self.sizes[0],
                    self.sizes[-1], "x".join(map(str, self.pixel_shape)), time.perf_counter() - start,
                    self.pool_bytes / 2**20)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor) -> torch.Tensor | None:
        """[n, tokens, hidden] (a view into the graph's memory: copy it before the next call), or
        None for a batch the graphs do not take (another shape, more images): run it eagerly."""
        n = pixels.shape[0]
        if tuple(pixels.shape[1:]) != self.pixel_shape or n > self.sizes[-1] or pixels.dtype != self.pixels.dtype:
            return None
        bs = next(s for s in self.sizes if s >= n)
        self.pixels[:n].copy_(pixels)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def patch_width(vision: nn.Module) -> int:
    """A packed tower's (Qwen2-VL's) row of pixels: channels x temporal patch x patch area."""
    cfg = vision.config
    return cfg.num_channels * cfg.temporal_patch_size * cfg.patch_size ** 2


def fixed_tokens(vision: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """A fixed-shape tower's tokens an image (one call over one blank image)."""
    cfg = vision.config
    with torch.inference_mode():
        return vision(torch.zeros(1, cfg.num_channels, cfg.image_size, cfg.image_size, dtype=dtype,
                                  device=device)).shape[1]


def packed_reserve(vision: nn.Module, max_tokens: int, dtype: torch.dtype, device: torch.device) -> int:
    """Peak bytes of one eager call of a packed tower over one image of about `max_tokens`
    tokens (a frame of merge x merge blocks, nearly square): what the largest capture's share of
    the pool comes to."""
    merge = vision.config.merge_size
    side = max(1, math.isqrt(max_tokens))
    grid = (1, merge * side, merge * max(1, max_tokens // side))
    patches = torch.zeros(math.prod(grid), patch_width(vision), dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        vision(patches, [grid])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def tower_graphs(vision: nn.Module, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[PackedTowerGraphs | FixedTowerGraphs | None, int]:
    """The tower's CUDA graphs for steps of at most `max_tokens` image tokens (the encoder budget)
    and the bytes to keep out of the KV pool for them; (None, 0) for a tower that has none
    (Pixtral, LLaVA-NeXT's tiles: eager)."""
    cfg = vision.config
    max_tokens = min(max_tokens, TOWER_GRAPH_MAX_TOKENS)
    if getattr(vision, "packed", False):
        if not hasattr(vision, "plan"):
            return None, 0
        # room for two of the largest entries' static buffers (patches and outputs)
        row = patch_width(vision) * cfg.merge_size ** 2 + cfg.text_hidden_size * (1 + getattr(vision, "deepstack_layers", 0))
        max_bytes = 2 * max_tokens * row * dtype.itemsize
        reserve = packed_reserve(vision, max_tokens, dtype, device) + max_bytes
        logger.info("vision tower CUDA graphs: calls of up to %d image tokens, %.1f MiB kept for them", max_tokens,
                    reserve / 2**20)
        return PackedTowerGraphs(vision, max_tokens, max_bytes, reserve), reserve
    if getattr(vision, "tiled", False) or not cfg.image_size:
        return None, 0
    shape = (cfg.num_channels, cfg.image_size, cfg.image_size)
    graphs = FixedTowerGraphs(vision, shape, max(1, max_tokens // fixed_tokens(vision, dtype, device)), dtype, device)
    try:
        graphs.capture()
    except Exception as e:  # a graph is an optimization: the tower runs eagerly without it
        logger.warning("capturing the vision tower's CUDA graphs failed (%s: %s): it runs eagerly", type(e).__name__, e)
        return None, 0
    return graphs, 0
