"""KV blocks copied between the device pool and host slots: the host tier's (scheduler/host_tier.py)
and the swap space's (scheduler/swap_space.py), as each plan lists them.

Host slots are slot-major, (slot, plane, layer, token, head, dim) in the cache's bytes, so a run of
consecutive slots is one contiguous stretch, moved by one copy call (two where it crosses from one
of HostSlots' pieces to the next); the device side is gathered into (or scattered from) a
contiguous staging tensor by one indexing kernel a batch of at most STAGING_BYTES.

On CUDA every copy runs on a copy stream of its own, and the CPU never waits for one (pinned host
memory, non_blocking copies):
- the copy stream first waits for the compute stream as the launch finds it, so a copy out reads
  what the steps before wrote, and a copy in lands after the steps before are done;
- copies out whose blocks this very step hands to new owners (`kv_offloads`: evictions its
  allocations made) end in an event the compute stream waits for before the step writes
  anything: the one case left on the step's path;
- copies out of blocks the scheduler evicted ahead of need (`kv_offloads_held`) and of the
  requests it preempted by swap (`swap_outs`) are waited for by nobody on the device: their
  blocks are held until the step is collected, and `collect` makes sure the copies are done first;
- copies in (a host-tier hit's, a swapped-in request's) end in an event that the forward of the
  step reading them waits for: this step's, or with `loads_ahead` (the scheduler runs their
  requests from the next step on) the next launch's, so this step's forward overlaps them.
On the CPU the copies run in place, in the same order.

The host tier's buffers (as large as the KV pool by default on CUDA: pinning takes ~0.4 s a GiB) are
made by a thread of their own that the runner starts once its start-up is done (`start_host_tier`:
after the CUDA graphs are captured, as a host allocation during a capture would break it), so the
engine is ready without waiting for them; the first launch that copies waits for them. The swap
space's, asked for by a flag of their own, are made at once.

Every cache over the pool's block ids moves together: the target's, and a draft model's own
(runner/draft_model.py), each into host slots of its own layout (a slot of the host tier or swap
space is one block of each)."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ember.layers.transfer import to_device
from ember.scheduler.scheduler import SchedulerOutput

# the most device memory a batch of copies stages (on the copy stream: the next batch reuses it),
# outside the KV pool and the activations' profile
STAGING_BYTES = 256 << 20


@dataclass
class IssuedCopies:
    """A step's copies, until `KVCopies.collect`."""

    done: torch.cuda.Event | None = None  # CUDA: after every copy of the step
    load_start: torch.cuda.Event | None = None  # CUDA: before its copies in
    wait_at_collect: bool = False  # held blocks or loads: collect waits for `done`
    load_seconds: float | None = None  # the CPU's in-place copies in, timed


class HostSlots:
    """n slots of one block each ([n, *slot_shape] bytes) in host memory, pinned for the GPU's
    copies, in pieces of just under a power of two bytes each: torch's caching host allocator
    pins the next power of two of any ask, so one buffer of n slots could pin up to twice what
    was asked (`--swap-space 24` pinned 32 GiB); the pieces pin what was asked, less than a slot
    over a piece (a piece takes over half of what is left: ~log2 pieces)."""

    def __init__(self, slot_shape: tuple[int, ...], num_slots: int, pin: bool) -> None:
        self.slot_shape, self.num_slots = tuple(slot_shape), num_slots
        slot_bytes = math.prod(slot_shape)
        self.pieces: list[torch.Tensor] = []
        self.starts: list[int] = []  # each piece's first slot
        first = 0
        while first < num_slots:
            left = num_slots - first
            n = min(left, max(1, (1 << (left * slot_bytes).bit_length() - 1) // slot_bytes))
            self.pieces.append(torch.empty((n, *slot_shape), dtype=torch.uint8, pin_memory=pin))
            self.starts.append(first)
            first += n

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.num_slots, *self.slot_shape))

    def spans(self, first: int, n: int) -> list[tuple[torch.Tensor, int]]:
        """Slots first .. first + n - 1 as (a view of a piece, its offset into the run), in order."""
        out = []
        for start, piece in zip(self.starts, self.pieces):
            lo, hi = max(first, start), min(first + n, start + len(piece))
            if lo < hi:
                out.append((piece[lo - start:hi - start], lo - first))
        return out


class KVCopies:
    """The copies of each plan (see the module's docstring), between the blocks of `kv_caches`
    (the target's first, then a drafter's) and the host buffers `host_blocks` makes for each."""

    def __init__(self, kv_caches: list[torch.Tensor], tier_slots: int, swap_slots: int) -> None:
        self.device = kv_caches[0].device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._tier_slots = tier_slots
        self._tier_caches = [c.to("meta") for c in kv_caches]  # their shapes, for the tier's buffers
        self._tier_made: Future[list[HostSlots | None]] | None = None  # start_host_tier's
        self._tier: list[HostSlots | None] | None = None if tier_slots else [None] * len(kv_caches)
        self.swap = [self.host_blocks(c, swap_slots) for c in kv_caches]
        self._waits_now: list[torch.cuda.Event] = []  # loads this launch's forward waits for
        self._waits_next: list[torch.cuda.Event] = []  # loads the next launch waits for

    def host_blocks(self, kv_cache: torch.Tensor, n: int) -> HostSlots | None:
        """n slots of one block each in host memory (pinned for the GPU's copies), slot-major."""
        if not n:
            return None
        raw = _raw(kv_cache)
        return HostSlots((*raw.shape[:2], *raw.shape[3:]), n, pin=self.device.type == "cuda")

    def start_host_tier(self) -> None:
        """Make the host tier's buffers in a thread of their own (the first copy waits for them)."""
        if self._tier_made is not None or self._tier is not None:
            return
        made = self._tier_made = Future()

        def make() -> None:
            try:
                made.set_result(self._make_tier())
            except BaseException as e:  # raised where the buffers are first used
                made.set_exception(e)

        # a daemon: a process that ends meanwhile does not wait for the pinning
        threading.Thread(target=make, name="ember-host-tier", daemon=True).start()

    def _make_tier(self) -> list[HostSlots | None]:
        if self.device.type == "cuda":  # a new thread's device is the first: pin with this rank's context
            torch.cuda.set_device(self.device)
        return [self.host_blocks(c, self._tier_slots) for c in self._tier_caches]

    @property
    def tier(self) -> list[HostSlots | None]:
        """The host tier's buffers, one a cache: made now if start_host_tier was not called, else
        once its thread is done (an error there is raised here)."""
        if self._tier is None:
            self.start_host_tier()
            self._tier, self._tier_made = self._tier_made.result(), None
        return self._tier

    def launch(self, plan: SchedulerOutput, kv_caches: list[torch.Tensor]) -> IssuedCopies | None:
        """Queue the plan's copies (before its block copies and forward); None when it has none."""
        outs = plan.kv_offloads  # their blocks' new owners write in this step
        # (a plan without the tier's copies does not wait for its buffers)
        tier = self.tier if outs or plan.kv_offloads_held or plan.kv_onloads else []
        held = [(plan.kv_offloads_held, tier), (plan.swap_outs, self.swap)]  # blocks held until collect
        ins = [(plan.kv_onloads, tier), (plan.swap_ins, self.swap)]
        has_held, has_ins = any(p for p, _ in held), any(p for p, _ in ins)
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        for event in self._waits_next:  # the last launch's loads, before this step touches a block
            compute.wait_event(event)
        self._waits_next = []
        if not (outs or has_held or has_ins):
            return None
        raw = [_raw(c) for c in kv_caches]
        if self.stream is None:
            for pairs, host in [(outs, tier), *held]:
                _copy_out(raw, host, pairs)
            start = time.perf_counter()
            for pairs, host in ins:
                _copy_in(raw, host, pairs)
            return IssuedCopies(load_seconds=time.perf_counter() - start if has_ins else None)
        issued = IssuedCopies(wait_at_collect=has_held or has_ins)
        self.stream.wait_stream(compute)  # after what the steps before wrote (a preempted request's last step)
        with torch.cuda.stream(self.stream):
            if outs:
                _copy_out(raw, tier, outs)
                handed = torch.cuda.Event()
                handed.record(self.stream)
                compute.wait_event(handed)
            for pairs, host in held:
                _copy_out(raw, host, pairs)
            if has_ins:
                issued.load_start = torch.cuda.Event(enable_timing=True)
                issued.load_start.record(self.stream)
            for pairs, host in ins:
                _copy_in(raw, host, pairs)
            issued.done = torch.cuda.Event(enable_timing=has_ins)
            issued.done.record(self.stream)
        if has_ins:
            (self._waits_next if plan.loads_ahead else self._waits_now).append(issued.done)
        return issued

    def before_forward(self) -> None:
        """The compute stream waits for the loads this step's forward reads."""
        if self._waits_now:
            compute = torch.cuda.current_stream(self.device)
            for event in self._waits_now:
                compute.wait_event(event)
            self._waits_now = []

    def collect(self, issued: IssuedCopies | None) -> float | None:
        """Once the step's copies are done (held blocks may then be reused): the seconds its
        copies in took, None without any."""
        if issued is None:
            return None
        if issued.done is None:
            return issued.load_seconds
        if issued.wait_at_collect:
            issued.done.synchronize()
        return issued.load_start.elapsed_time(issued.done) / 1e3 if issued.load_start is not None else None


def _raw(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes (any dtype, fp8 included, indexes and copies as uint8)."""
    return kv_cache.view(torch.uint8)


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index into `slots`, first slot, length) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def _batches(raw: torch.Tensor, pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`pairs` cut so that each batch's staging tensor holds at most STAGING_BYTES (one block at least)."""
    per_batch = max(1, STAGING_BYTES // (raw[:, :, 0].numel()))
    return [pairs[i:i + per_batch] for i in range(0, len(pairs), per_batch)]


def copy_blocks(caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Block dst takes block src's KV, `pairs` (src, dst), in each cache: a gather and a scatter a
    batch (a copy a block launched hundreds of kernels a beam-search step). Sources are held
    cached blocks and destinations fresh ones, so no pair reads what another writes."""
    for raw in map(_raw, caches):
        for batch in _batches(raw, pairs):
            src, dst = (to_device(list(x), raw.device, torch.int64) for x in zip(*batch))
            raw.index_copy_(2, dst, raw.index_select(2, src))


def _copy_out(caches: list[torch.Tensor], hosts: list[HostSlots | None], pairs: list[tuple[int, int]]) -> None:
    """Device blocks to host slots, `pairs` (block, slot), of each cache: a gather a batch, a copy a run of slots."""
    for raw, host in zip(caches, hosts):
        for batch in _batches(raw, pairs):
            blocks, slots = (list(x) for x in zip(*batch))
            staged = raw.index_select(2, to_device(blocks, raw.device, torch.int64)).movedim(2, 0).contiguous()
            for i, first, n in slot_runs(slots):
                for view, j in host.spans(first, n):
                    view.copy_(staged[i + j:i + j + len(view)], non_blocking=True)


def _copy_in(caches: list[torch.Tensor], hosts: list[HostSlots | None], pairs: list[tuple[int, int]]) -> None:
    """Host slots to device blocks, `pairs` (slot, block), of each cache: a copy a run of slots, a scatter a batch."""
    for raw, host in zip(caches, hosts):
        for batch in _batches(raw, pairs):
            slots, blocks = (list(x) for x in zip(*batch))
            staged = torch.empty((len(slots), *host.slot_shape), dtype=torch.uint8, device=raw.device)
            for i, first, n in slot_runs(slots):
                for view, j in host.spans(first, n):
                    staged[i + j:i + j + len(view)].copy_(view, non_blocking=True)
            raw.index_copy_(2, to_device(blocks, raw.device, torch.int64), staged.movedim(0, 2))
