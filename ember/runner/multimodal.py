"""The image side of a step: each chunk that covers an image's placeholder tokens gets that
image's embeddings in those rows, in place of the tokens'. The vision model (tower and
projector) runs once for the step's images that the encoder cache lacks, batched; a chunk
boundary may fall inside an image (chunked prefill, a prefix-cache hit that ends there): a
chunk takes the slice of the image's embeddings its positions cover. Only the rows whose token is
the image token (or the video token) take an embedding: Pixtral's runs hold [IMG_BREAK] /
[IMG_END] tokens too, which keep their own. Qwen3-VL's tower gives each image token deepstack rows
too, which the text model adds to its first layers' outputs at those rows (`ImageInputs.deepstack`).

    prompt    t t t [i0 i1 i2 i3] t t
    chunk 1   t t t  i0 i1|               rows 3..4 <- image[0:2]
    chunk 2                 |i2 i3 t t    rows 0..1 <- image[2:4]

Gemma 3 (`VisionConfig.bidirectional_images`): an image's tokens see each other both ways, so a
step's attention takes `image_key_ends` (layers/attention/base.py's key_ends) and the scheduler
never ends a chunk inside an image (encoder_budget.py); a chunk may begin inside one, after a
prefix hit whose cached blocks hold the image's first tokens, computed seeing all of it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ember.layers.transfer import join_to_device
from ember.models.llama import Deepstack
from ember.multimodal.inputs import ImageFeature
from ember.runner.tower_graphs import FixedTowerGraphs, PackedTowerGraphs, fixed_tokens, patch_width
from ember.scheduler.scheduler import SchedulerOutput

ENCODER_CACHE_BYTES = 256 << 20  # image embeddings kept for reuse beyond those running requests still need


class EncoderCache:
    """Image embeddings by the image's hash. An entry is held by the requests whose prefill
    has yet to pass its image (`hold`, let go by `done` or `release`); held entries stay,
    the others are dropped least recently used first once the cache is over `max_bytes`.
    max_bytes None: it drops only what it is told to (`drop`: a tensor-parallel rank's, whose
    drops the engine's mirror decides, EncoderCacheMirror). The mirror's entries are None: it
    keeps each embedding's size alone."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor | None] = OrderedDict()
        self.sizes: dict[str, int] = {}
        self.holders: dict[str, set[str]] = {}  # hash -> ids of requests holding it
        self.held: dict[str, set[str]] = {}  # request id -> hashes it holds
        self.nbytes = 0

    def get(self, key: str) -> torch.Tensor | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor | None, nbytes: int | None = None) -> None:
        """Keep `value` (its size: nbytes, by default its own)."""
        self.drop([key])
        self.entries[key] = value
        self.sizes[key] = value.nbytes if nbytes is None else nbytes
        self.nbytes += self.sizes[key]
        self._shrink()

    def drop(self, keys: list[str]) -> None:
        for key in keys:
            if key in self.sizes:
                del self.entries[key]
                self.nbytes -= self.sizes.pop(key)

    def hold(self, request_id: str, key: str) -> None:
        self.holders.setdefault(key, set()).add(request_id)
        self.held.setdefault(request_id, set()).add(key)

    def done(self, request_id: str, key: str) -> None:
        """The request's prefill has passed this image: it needs its embeddings no more."""
        self._drop_holder(request_id, key)
        keys = self.held.get(request_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.held[request_id]
        self._shrink()

    def release(self, request_id: str) -> None:
        """The request left (finished, aborted, failed, preempted)."""
        for key in self.held.pop(request_id, ()):
            self._drop_holder(request_id, key)
        self._shrink()

    def _drop_holder(self, request_id: str, key: str) -> None:
        holders = self.holders.get(key)
        if holders is not None:
            holders.discard(request_id)
            if not holders:
                del self.holders[key]

    def _shrink(self) -> None:
        if self.max_bytes is None:
            return
        for key in list(self.entries):
            if self.nbytes <= self.max_bytes:
                return
            if key not in self.holders:
                self.drop([key])


@dataclass
class ImageInputs:
    """What a step over image tokens gives the model beside its token ids."""

    embeds: torch.Tensor  # [T, hidden]: the tokens' embeddings, image rows replaced
    deepstack: Deepstack | None = None  # Qwen3-VL: the rows and what each of the first layers adds there


@dataclass
class _Span:
    row: int  # the step's row of its first covered position
    feature: ImageFeature
    start: int  # the covered slice of the image's embeddings
    stop: int
    request_id: str


class ImageEmbedder:
    """The step's input embeddings where its chunks cover image tokens (see the module's note)."""

    def __init__(self, vision: nn.Module, embed: nn.Module, device: torch.device, token_ids: tuple[int, ...],
                 max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        # pixel_values [B, C, H, W] -> [B, tokens, hidden]; a `packed` one (Qwen2-VL): the images'
        # patches concatenated and their grids -> each image's [tokens, hidden]
        # a `tiled` one (LLaVA-NeXT): the images' views concatenated and their sizes -> each image's
        # [tokens, hidden]
        self.vision = vision
        self.embed = embed  # token ids -> input embeddings (LlamaModel.embed)
        self.token_ids = torch.tensor(token_ids, device=device)  # the placeholders an embedding replaces
        self.deepstack_layers = getattr(vision, "deepstack_layers", 0)  # Qwen3-VL's
        self.device = device
        self.cache = EncoderCache(max_bytes)
        self.num_encoded = 0  # images the vision model ran for (tests, stats)
        self.num_encoder_steps = 0  # steps in which it ran (the scheduler's encoder budget spreads images over more)
        # CUDA graphs of the tower (runner/tower_graphs.py; set by the runner on CUDA unless eager)
        self.graphs: PackedTowerGraphs | FixedTowerGraphs | None = None
        self.num_tower_replays = 0  # tower calls replayed as a CUDA graph
        self.num_tower_eager = 0  # tower calls run eagerly (every one without graphs)

    def inputs(self, plan: SchedulerOutput, input_ids: torch.Tensor) -> ImageInputs | None:
        """None when no chunk of the step covers an image token."""
        spans = self._spans(plan)
        if not spans:
            return None
        self._encode([s.feature for s in spans])
        x = self.embed(input_ids)
        hidden, rows, stacked = x.shape[-1], [], []
        for s in spans:
            span = slice(s.row, s.row + s.stop - s.start)
            out = self.cache.get(s.feature.hash)[s.start:s.stop].to(x.dtype)
            placed = torch.isin(input_ids[span], self.token_ids)
            x[span] = torch.where(placed[:, None], out[:, :hidden], x[span])
            if self.deepstack_layers:  # Qwen3-VL: every row of its runs is an image token
                rows.append(torch.arange(span.start, span.stop, device=x.device))
                stacked.append(out[:, hidden:].view(-1, self.deepstack_layers, hidden))
            if s.stop == s.feature.length:
                self.cache.done(s.request_id, s.feature.hash)
        deepstack = (torch.cat(rows), torch.cat(stacked).transpose(0, 1)) if rows else None
        return ImageInputs(x, deepstack)

    @torch.inference_mode()
    def profile_inputs(self, input_ids: torch.Tensor, max_tokens: int) -> ImageInputs | None:
        """A full step's inputs as if its rows were image tokens encoded in that step: the tower
        run over dummy images of up to `max_tokens` tokens (the encoder budget) and its
        embeddings placed over the first rows, as `inputs` places a step's. For the runner's
        start-up profile, which so measures the tower's peak at its budget (an eager call: its
        graphs cover smaller ones) and runs its kernels once before the first request. None for
        a tiled tower (LLaVA-NeXT: views of each image's own size)."""
        dtype = next(self.vision.parameters()).dtype
        cfg = self.vision.config
        if getattr(self.vision, "packed", False):  # images of about 1,024 tokens each, as many as fit
            merge = cfg.merge_size
            counts = [1024] * (max_tokens // 1024) + ([max_tokens % 1024] if max_tokens % 1024 else [])
            grids = [(1, merge * min(n, 32), merge * (n // min(n, 32))) for n in counts]  # a x b <= n tokens
            patches = torch.zeros(sum(math.prod(g) for g in grids), patch_width(self.vision), dtype=dtype,
                                  device=self.device)
            out = torch.cat(self.vision(patches, grids))
        elif getattr(self.vision, "tiled", False):
            return None
        else:  # fixed-shape: as many images as the budget holds
            images = max(1, max_tokens // fixed_tokens(self.vision, dtype, self.device))
            pixels = torch.zeros(images, cfg.num_channels, cfg.image_size, cfg.image_size, dtype=dtype,
                                 device=self.device)
            out = self.vision(pixels).flatten(0, 1)
        x = self.embed(input_ids)
        rows = min(len(out), len(x))
        hidden = x.shape[-1]
        x[:rows] = out[:rows, :hidden].to(x.dtype)
        deepstack = None
        if self.deepstack_layers:
            deepstack = (torch.arange(rows, device=x.device),
                         out[:rows, hidden:].reshape(rows, self.deepstack_layers, hidden).transpose(0, 1))
        return ImageInputs(x, deepstack)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def _spans(self, plan: SchedulerOutput) -> list[_Span]:
        spans = image_spans(plan)
        for s in spans:
            self.cache.hold(s.request_id, s.feature.hash)
        return spans

    @torch.inference_mode()
    def _encode(self, features: list[ImageFeature]) -> None:
        """Run the vision model once over the images the cache lacks, those of one shape batched."""
        missing = list({f.hash: f for f in features if self.cache.get(f.hash) is None}.values())
        if not missing:
            return
        for f in missing:
            if not f.pixel_values.size:  # a tensor-parallel rank: the engine's mirror sends them (EncoderCacheMirror)
                raise RuntimeError(f"image {f.hash}: this rank's encoder cache lacks its embeddings and its pixels did "
                                   "not come with the step")
        self.num_encoder_steps += 1
        dtype = next(self.vision.parameters()).dtype
        if getattr(self.vision, "packed", False):  # Qwen2-VL: images of any sizes in one call, patches concatenated
            patches = join_to_device([f.pixel_values for f in missing], self.device, dtype)
            grids = [f.grid_thw for f in missing]
            if self.graphs is not None:
                outs, replayed = self.graphs(patches, grids)
            else:
                outs, replayed = self.vision(patches, grids), False
            self._count(replayed)
            for f, out in zip(missing, outs):
                self.cache.put(f.hash, out.clone())  # its own memory, which the cache's byte count sees
            self.num_encoded += len(missing)
            return
        if getattr(self.vision, "tiled", False):  # LLaVA-NeXT: every view of every image in one batch
            views = join_to_device([f.pixel_values for f in missing], self.device, dtype)
            self._count(False)
            for f, out in zip(missing, self.vision(views, [f.image_size for f in missing])):
                self.cache.put(f.hash, out)
            self.num_encoded += len(missing)
            return
        by_shape: dict[tuple[int, ...], list[ImageFeature]] = {}
        for f in missing:
            by_shape.setdefault(f.pixel_values.shape, []).append(f)
        for group in by_shape.values():
            pixels = join_to_device([f.pixel_values for f in group], self.device, dtype, stack=True)
            outs = self.graphs(pixels) if self.graphs is not None else None
            self._count(outs is not None)
            for f, out in zip(group, self.vision(pixels) if outs is None else outs):
                self.cache.put(f.hash, out.clone())  # its own memory, not a view of the batch's (or the graph's)
            self.num_encoded += len(group)

    def _count(self, replayed: bool) -> None:
        if replayed:
            self.num_tower_replays += 1
        else:
            self.num_tower_eager += 1


def image_spans(plan: SchedulerOutput) -> list[_Span]:
    """The step's rows over image tokens: each image a chunk covers, and the slice it covers."""
    spans, row = [], 0
    for chunk in plan.chunks:
        req = chunk.request
        start = req.num_computed_tokens
        end = min(start + chunk.num_new_tokens, req.num_prompt_tokens)
        for f in req.mm_features or ():
            lo, hi = max(start, f.offset), min(end, f.end)
            if lo < hi:
                spans.append(_Span(row + lo - start, f, lo - f.offset, hi - f.offset, req.request_id))
        row += chunk.num_new_tokens
    return spans


class EncoderCacheMirror:
    """The engine's copy of the tensor-parallel ranks' encoder caches. Every rank runs the
    (replicated) tower over the same images and keeps the same embeddings; this copy, in the
    engine's process, runs the cache's bookkeeping as ImageEmbedder does, with each entry's
    size (its tokens x `row_bytes`) in place of its embeddings, and decides for the ranks:
    which images a step starts encoding, whose pixels it carries to them (the only time they
    travel), and which entries the ranks drop (those it evicted since: with the next step, or
    with the release that evicted them), so the ranks' caches hold what it holds, evictions
    included."""

    def __init__(self, max_bytes: int, row_bytes: int) -> None:
        self.cache = EncoderCache(max_bytes)
        self.row_bytes = row_bytes  # an image token's embedding (and its deepstack rows), in bytes
        self.on_ranks: set[str] = set()  # what the ranks' caches hold once they have run the last step
        self.num_encoded = 0  # images whose pixels went to the ranks
        self.num_encoder_steps = 0

    def step(self, plan: SchedulerOutput) -> tuple[dict[str, np.ndarray], list[str]]:
        """(hash -> pixels of the images the ranks encode in this step, the hashes they drop
        before it), with the cache's bookkeeping of the step done (ModelRunner.launch's order:
        the preempted requests let go first)."""
        dropped = self.take_dropped()
        for req in plan.preempted:
            self.cache.release(req.request_id)
        spans = image_spans(plan)
        for s in spans:
            self.cache.hold(s.request_id, s.feature.hash)
        missing: dict[str, ImageFeature] = {}
        for s in spans:
            if s.feature.hash in self.cache.entries:
                self.cache.get(s.feature.hash)
            else:
                missing.setdefault(s.feature.hash, s.feature)
        for f in missing.values():
            self.cache.put(f.hash, None, f.length * self.row_bytes)
        for s in spans:
            self.cache.get(s.feature.hash)
            if s.stop == s.feature.length:
                self.cache.done(s.request_id, s.feature.hash)
        pixels = {key: f.pixel_values for key, f in missing.items()}
        self.on_ranks |= pixels.keys()
        if pixels:
            self.num_encoded += len(pixels)
            self.num_encoder_steps += 1
        return pixels, dropped

    def release(self, request_id: str) -> list[str]:
        """Let the request's images go; the hashes the ranks drop now."""
        self.cache.release(request_id)
        return self.take_dropped()

    def take_dropped(self) -> list[str]:
        """What the ranks hold and this copy dropped since (the last step's evictions, a release's)."""
        dropped = sorted(self.on_ranks.difference(self.cache.entries))
        self.on_ranks.difference_update(dropped)
        return dropped


def image_key_ends(plan: SchedulerOutput, positions: Sequence[int]) -> list[int] | None:
    """A step's key_ends (layers/attention/base.py) for a model whose image tokens see their whole
    image (Gemma 3): each row's position + 1, an image token's its image's end; None when no
    chunk covers an image token (the step stays causal). `positions`: the step's rows'."""
    ends, row = None, 0
    for chunk in plan.chunks:
        req = chunk.request
        start = req.num_computed_tokens
        end = start + chunk.num_new_tokens
        for f in req.mm_features or ():
            lo, hi = max(start, f.offset), min(end, f.end)
            if lo >= hi:
                continue
            if f.end > end:
                raise RuntimeError(f"request {req.request_id}: a chunk of tokens {start}..{end} ends inside an image "
                                   f"of tokens {f.offset}..{f.end}, whose tokens must be computed in one step")
            if ends is None:
                ends = [p + 1 for p in positions]
            ends[row + lo - start:row + hi - start] = [f.end] * (hi - lo)
        row += chunk.num_new_tokens
    return ends
