"""Snapshots of a recurrent state at block boundaries, so that a prefix-cache hit of a model with
linear-attention layers (Qwen3-Next's gated DeltaNet) can resume where the cached prefix ended
(vLLM's mamba prefix caching in align mode; SGLang keeps such states at its radix nodes).

A cached prefix's KV blocks are all its attention layers need; a linear-attention layer needs its
conv and recurrent state after the prefix's last token, which no block holds. So the runner keeps a
pool of snapshot slots (runner/recurrent_state.py) beside the request slots, and this bookkeeping
says which cached prefix each slot holds the state of: the prefix that ends with a cached block,
keyed by that block's id (in the radix tree a cached block stands for its whole path, as a block
hash does in vLLM).

- Where: a chunk that ends on a block boundary saves its request's state there, after the step's
  forward (`take`). Prefill chunks are cut (`chunk`) to end on block boundaries; a prompt's last
  chunk starts at the last boundary before its last token; and a request whose cached KV goes on
  past its hit's snapshot ends a chunk where that KV ends, the point where it parts from what was
  cached (a system prompt shared by several requests: the second leaves a snapshot at its end,
  the third hits it). So a prompt leaves a snapshot at each chunk's end and at its last whole
  block. Decoding saves at each boundary it reaches and keeps only its latest (`keyed`): a turn's
  last one is what the next turn's prompt (this turn's prompt, its answer, new text) hits.
- Keyed once its block enters the prefix cache (`keyed`; with async scheduling a decode step's
  block is complete only when its pending token is known). Until then the slot is its request's,
  given back if the request leaves or is preempted first (`release`).
- A hit is cut to the longest cached prefix that ends at a keyed block (`usable_hit`); the
  request's fresh state slot is filled from that snapshot (`restore`) before the step's forward.
- Bounded: a fixed number of slots, sized from memory by the runner. A save that finds none free
  takes the least recently used keyed one; a snapshot goes when the prefix cache evicts its block
  (`evicted`): without that block's KV it is of no use, and the block id is soon another's.
  Nothing is held by a request once it has left: a restore copies the snapshot before the
  forward, so a save in the same step or later may reuse its slot.
"""

from __future__ import annotations

from collections import OrderedDict

from ember.request import Request


class NoStateSnapshots:
    """A model without recurrent layers (or no prefix cache): hits and chunks stay as they are."""

    def chunk(self, req: Request, num_new_tokens: int) -> int:
        return num_new_tokens

    def usable_hit(self, req: Request, hit: list[int], usable: int) -> int:
        return usable

    def restore(self, req: Request) -> int | None:
        return None

    def take(self, request_id: str, position: int) -> int | None:
        return None

    def keyed(self, req: Request) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def evicted(self, block_id: int) -> None:
        pass

    def held_for(self) -> set[str]:
        return set()

    def check_integrity(self, cached: list[bool]) -> None:
        pass


class StateSnapshots(NoStateSnapshots):
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.by_block: OrderedDict[int, int] = OrderedDict()  # block id -> slot, least recently used first
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request id -> (position, slot) saved, not keyed
        self.cuts: dict[str, int] = {}  # request id -> where its cached KV ends, past its hit: a chunk ends there

    def chunk(self, req: Request, num_new_tokens: int) -> int:
        """Cut a chunk of the request's tokens so that it ends on a block boundary where it can,
        and never goes past the end of its cached KV (`usable_hit`) nor past the last boundary
        before its last token (a prompt's last chunk is its tail after its last whole block):

            block_size 8, 27 tokens, 5-token budget:  0-5  5-8 | 8-13  13-16 | 16-21  21-24 | 24-27
        """
        if not self.num_slots:
            return num_new_tokens
        bs, start, end = self.block_size, req.num_computed_tokens, req.num_computed_tokens + num_new_tokens
        cut = self.cuts.get(req.request_id, 0)
        if start >= cut:
            self.cuts.pop(req.request_id, None)
            cut = (req.num_tokens - 1) // bs * bs
        if start < cut < end:
            return cut - start
        if end < req.num_tokens and end // bs * bs > start:
            return end // bs * bs - start
        return num_new_tokens

    def usable_hit(self, req: Request, hit: list[int], usable: int) -> int:
        """How many of the hit's first `usable` blocks the request takes: up to the last one with a
        snapshot. Where its usable blocks go further, its chunks are cut there (`chunk`)."""
        n = next((n for n in range(usable, 0, -1) if hit[n - 1] in self.by_block), 0)
        self.cuts.pop(req.request_id, None)
        if n < usable:
            self.cuts[req.request_id] = usable * self.block_size
        return n

    def restore(self, req: Request) -> int | None:
        """The snapshot an admitted request's state starts from: its hit's last block's (None: no hit)."""
        if not req.num_computed_tokens:
            return None
        block = req.block_ids[req.num_computed_tokens // self.block_size - 1]
        self.by_block.move_to_end(block)
        return self.by_block[block]

    def take(self, request_id: str, position: int) -> int | None:
        """The slot to save the request's state into when its chunk ends at `position`: on a block
        boundary, else None; None too when every slot waits for its block (nothing to evict)."""
        if position % self.block_size:
            return None
        if not self.free:
            if not self.by_block:
                return None
            self.free.append(self.by_block.popitem(last=False)[1])
        slot = self.free.pop()
        self.pending.setdefault(request_id, []).append((position, slot))
        return slot

    def keyed(self, req: Request) -> None:
        """Key the request's saved states whose block the prefix cache now holds. One the cache
        has a snapshot for already (the same prefix computed twice) goes back; a decode step's
        replaces the request's own one block back, unless that one ends a prompt chunk."""
        pending = self.pending.get(req.request_id)
        if not pending:
            return
        bs, cached = self.block_size, req.num_blocks_in_cache * self.block_size
        for position, slot in [p for p in pending if p[0] <= cached]:
            pending.remove((position, slot))
            block = req.block_ids[position // bs - 1]
            if block in self.by_block:
                self.by_block.move_to_end(block)
                self.free.append(slot)
            else:
                self.by_block[block] = slot
            if position - bs > req.num_prompt_tokens:
                self.evicted(req.block_ids[position // bs - 2])
        if not pending:
            del self.pending[req.request_id]

    def release(self, request_id: str) -> None:
        """The request left or was preempted: its states not yet keyed go back."""
        self.free += [slot for _, slot in self.pending.pop(request_id, [])]
        self.cuts.pop(request_id, None)

    def held_for(self) -> set[str]:
        """The requests it keeps anything for: saves not yet keyed, cuts."""
        return set(self.pending) | set(self.cuts)

    def evicted(self, block_id: int) -> None:
        """The prefix cache gave the block back (or a later snapshot replaced this one): its snapshot goes."""
        slot = self.by_block.pop(block_id, None)
        if slot is not None:
            self.free.append(slot)

    def check_integrity(self, cached: list[bool]) -> None:
        """Every slot free, keyed to a block the prefix cache holds (`cached`: the pool's marks), or pending."""
        slots = self.free + list(self.by_block.values()) + [s for p in self.pending.values() for _, s in p]
        assert sorted(slots) == list(range(self.num_slots)), f"snapshot slots lost or doubled: {sorted(slots)}"
        stale = [b for b in self.by_block if not cached[b]]
        assert not stale, f"snapshots keyed by blocks {stale} that the prefix cache no longer holds"
