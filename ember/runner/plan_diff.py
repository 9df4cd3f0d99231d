"""A step's plan as the tensor-parallel workers need it, sent as a diff of what they hold.

The workers keep a mirror of each running request (a `Request` they received whole once).
Each step then carries, per scheduled chunk, only what changed since the last step that
scheduled it: the output tokens appended since, the block ids appended since (or the whole
list when the scheduler replaced it: preemption, a fork, a prefix-cache swap, blocks a
sliding window gave back), and the counters the runner reads. At 512 running requests of
2,000 tokens this is a few KB a step instead of every request's whole token list.

A vision-language model's requests go without their images' pixels: a step carries the
pixels of the images whose encoding it starts (those the ranks' encoder caches lack, as the
engine's mirror of them says: runner/multimodal.py's EncoderCacheMirror), and the hashes
the ranks' caches drop. The workers put the pixels on their mirrors for that step alone.

It relies on two facts of the scheduler: a request's `output_token_ids` only grows, and
its `block_ids` list only grows in place (a change other than appending makes a new list).
ModelRunner._table_row relies on the second too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ember.request import Request
from ember.runner.multimodal import EncoderCacheMirror
from ember.scheduler.scheduler import ScheduledChunk, SchedulerOutput

NO_PIXELS = np.empty(0, np.float32)  # an image's pixel_values on a worker's mirror, but in the step that encodes it

# (request id, num_new_tokens, start, samples, num_pending_tokens, new output ids,
#  block ids, whether those replace the list rather than extend it, the drafts it verifies)
ChunkDiff = tuple[str, int, int, bool, int, list[int], list[int], bool, list[int]]


@dataclass
class PlanDiff:
    new: list[Request] = field(default_factory=list)  # requests the workers have not seen: whole
    chunks: list[ChunkDiff] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[str, int]] = field(default_factory=list)  # SchedulerOutput's, as they are
    state_saves: list[tuple[str, int]] = field(default_factory=list)
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)  # the host tier's copies, as they are
    kv_onloads: list[tuple[int, int]] = field(default_factory=list)
    kv_offloads_held: list[tuple[int, int]] = field(default_factory=list)
    loads_ahead: bool = False
    swap_outs: list[tuple[int, int]] = field(default_factory=list)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # SchedulerOutput's, by id
    pixels: dict[str, np.ndarray] = field(default_factory=dict)  # image hash -> its pixels: the ranks encode it now
    dropped_images: list[str] = field(default_factory=list)  # hashes the ranks' encoder caches drop first


@dataclass
class RequestsDiff:
    """Requests as a drafter needs them after an update (speculative decoding under tensor
    parallelism): their new tokens, blocks and computed count since the workers last saw them."""

    new: list[Request] = field(default_factory=list)
    # (request id, new output ids, block ids, whether those replace the list, num_computed_tokens)
    updates: list[tuple[str, list[int], list[int], bool, int]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)


@dataclass
class _Sent:
    blocks: list[int]  # the scheduler's list object the workers' copy follows
    num_blocks: int
    num_outputs: int


class PlanEncoder:
    """The engine's side: what each request's mirror holds, so a step sends only what changed;
    `images`: a vision-language model's mirror of the ranks' encoder caches."""

    def __init__(self, images: EncoderCacheMirror | None = None) -> None:
        self.sent: dict[str, _Sent] = {}
        self.images = images

    def encode(self, plan: SchedulerOutput) -> PlanDiff:
        diff = PlanDiff(block_copies=plan.block_copies, state_restores=plan.state_restores,
                        state_saves=plan.state_saves, kv_offloads=plan.kv_offloads, kv_onloads=plan.kv_onloads,
                        kv_offloads_held=plan.kv_offloads_held, loads_ahead=plan.loads_ahead,
                        swap_outs=plan.swap_outs, swap_ins=plan.swap_ins,
                        preempted=[r.request_id for r in plan.preempted])
        if self.images is not None:
            diff.pixels, diff.dropped_images = self.images.step(plan)
        for c in plan.chunks:
            req = c.request
            new_outputs, new_blocks, whole = self._delta(req, diff.new)
            diff.chunks.append((req.request_id, c.num_new_tokens, c.start, c.samples, req.num_pending_tokens,
                                new_outputs, new_blocks, whole, c.draft_token_ids))
        return diff

    def encode_requests(self, requests: list[Request]) -> RequestsDiff:
        diff = RequestsDiff(order=[r.request_id for r in requests])
        for req in requests:
            new_outputs, new_blocks, whole = self._delta(req, diff.new)
            diff.updates.append((req.request_id, new_outputs, new_blocks, whole, req.num_computed_tokens))
        return diff

    def _delta(self, req: Request, new: list[Request]) -> tuple[list[int], list[int], bool]:
        """What changed in a request since the workers' mirror (a request they lack: sent whole)."""
        blocks, outputs = req.block_ids, req.output_token_ids
        sent = self.sent.get(req.request_id)
        if sent is None:
            new.append(_without_pixels(req))
            new_outputs, new_blocks, whole = [], [], False
        else:
            new_outputs = outputs[sent.num_outputs:]
            whole = sent.blocks is not blocks or sent.num_blocks > len(blocks)
            new_blocks = list(blocks) if whole else blocks[sent.num_blocks:]
        self.sent[req.request_id] = _Sent(blocks, len(blocks), len(outputs))
        return new_outputs, new_blocks, whole

    def forget(self, request_id: str) -> list[str]:
        """The request left; the images the ranks' encoder caches drop with it (hashes)."""
        self.sent.pop(request_id, None)
        return self.images.release(request_id) if self.images is not None else []


def _without_pixels(req: Request) -> Request:
    """The request as the workers' mirror gets it: its images (and its parent's, a fork's) without pixels."""
    if not req.mm_features:
        return req
    features = [dataclasses.replace(f, pixel_values=NO_PIXELS) for f in req.mm_features]
    parent = None if req.parent is None else _without_pixels(req.parent)
    return dataclasses.replace(req, mm_features=features, parent=parent)


class PlanDecoder:
    """A worker's side: the mirrors, and the plan rebuilt on them."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self.with_pixels: list[tuple[Request, list]] = []  # (request, its features without pixels) of the last step

    def decode(self, diff: PlanDiff) -> SchedulerOutput:
        for req, features in self.with_pixels:  # the last step has encoded them
            req.mm_features = features
        self.with_pixels = []
        self._take(diff.new)
        plan = SchedulerOutput(block_copies=diff.block_copies, state_restores=diff.state_restores,
                               state_saves=diff.state_saves, kv_offloads=diff.kv_offloads, kv_onloads=diff.kv_onloads,
                               kv_offloads_held=diff.kv_offloads_held, loads_ahead=diff.loads_ahead,
                               swap_outs=diff.swap_outs, swap_ins=diff.swap_ins,
                               preempted=[self.requests[i] for i in diff.preempted if i in self.requests])
        for request_id, num_new, start, samples, pending, outputs, blocks, whole, drafts in diff.chunks:
            req = self._apply(request_id, outputs, blocks, whole)
            req.num_computed_tokens, req.num_pending_tokens = start, pending
            chunk = ScheduledChunk(req, num_new, drafts)
            chunk.start, chunk.samples = start, samples
            plan.chunks.append(chunk)
            if diff.pixels and req.mm_features and any(f.hash in diff.pixels for f in req.mm_features):
                self.with_pixels.append((req, req.mm_features))
                req.mm_features = [dataclasses.replace(f, pixel_values=diff.pixels[f.hash]) if f.hash in diff.pixels
                                   else f for f in req.mm_features]
        return plan

    def decode_requests(self, diff: RequestsDiff) -> list[Request]:
        self._take(diff.new)
        for request_id, outputs, blocks, whole, computed in diff.updates:
            self._apply(request_id, outputs, blocks, whole).num_computed_tokens = computed
        return [self.requests[request_id] for request_id in diff.order]

    def _take(self, new: list[Request]) -> None:
        for req in new:
            req.block_ids = list(req.block_ids)  # its own list: appended to in place from here on
            self.requests[req.request_id] = req

    def _apply(self, request_id: str, outputs: list[int], blocks: list[int], whole: bool) -> Request:
        req = self.requests[request_id]
        req.output_token_ids += outputs
        if whole:
            req.block_ids = blocks
        else:
            req.block_ids += blocks
        return req

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
