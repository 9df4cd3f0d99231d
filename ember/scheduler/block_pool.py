"""The pool of paged KV blocks: a free queue, a ref count per block, and which blocks the
prefix cache holds.

Every block is in exactly one of three states:

    free       ref count 0, not cached: in the free queue
    in use     ref count > 0 (cached or not): some request's block table holds it
    evictable  ref count 0, cached: its KV is kept for a later prefix hit, and the prefix
               cache gives it back (evicts it) when the free queue runs short

so `num_free + num_in_use + num_evictable == num_blocks` always.

One more id, `null_block` (== num_blocks), is outside the pool: a block-table entry points
at it where no block is held (a block no sliding window reaches any more, a hole in the
prefix cache). Only a model whose every layer has a window makes such entries, and then the
runner's KV cache has that extra block, all zeros and never written; attention masks those
positions, so reading zeros there is harmless.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Evictor(Protocol):
    def evict(self, num_blocks: int) -> None:
        """Give at least `num_blocks` evictable blocks back to the free queue (`BlockPool.uncache`)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks
        self.num_evictable = 0
        self.evictor: Evictor | None = None  # the prefix cache, when one holds blocks
        self._free: deque[int] = deque(range(num_blocks))  # allocate from the left, free to the right

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones, then evictable ones."""
        return len(self._free) + self.num_evictable

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - len(self._free) - self.num_evictable

    @property
    def usage(self) -> float:
        return self.num_in_use / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            if n > self.num_available:
                raise RuntimeError(f"asked for {n} KV blocks, {self.num_available} available")
            assert self.evictor is not None
            self.evictor.evict(n - len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """Another owner holds these blocks too (an evictable block comes back into use)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                assert self.cached[b], f"block {b} is free"
                self.num_evictable -= 1
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block. A block with none left goes back to the free
        queue, or stays evictable if cached. Blocks are freed last-first so a request's
        tail is reused before its head."""
        for b in reversed(block_ids):
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.cached[b]:
                    self.num_evictable += 1
                else:
                    self._free.append(b)

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache now holds this in-use block's KV."""
        assert self.ref_counts[block_id] > 0 and not self.cached[block_id], f"block {block_id} can't be cached"
        self.cached[block_id] = True

    def uncache(self, block_id: int) -> None:
        """The prefix cache let go of this block: an evictable one is free; one in use goes to
        the free queue when its last holder frees it."""
        assert self.cached[block_id], f"block {block_id} is not cached"
        self.cached[block_id] = False
        if self.ref_counts[block_id] == 0:
            self.num_evictable -= 1
            self._free.append(block_id)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free queue twice"
        evictable = 0
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has ref count {rc}"
            assert (b in free) == (rc == 0 and not self.cached[b]), \
                f"block {b}: ref count {rc}, cached={self.cached[b]}, but free={b in free}"
            evictable += rc == 0 and self.cached[b]
        assert evictable == self.num_evictable, f"{evictable} evictable blocks, counted {self.num_evictable}"
        assert self.num_free + self.num_in_use + self.num_evictable == self.num_blocks
