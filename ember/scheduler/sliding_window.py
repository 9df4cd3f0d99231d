"""Which of a request's KV blocks its queries can still see.

With a sliding window W on every layer (Mistral v0.1, Phi-3-mini, Qwen2 with every layer
windowed) a query at position p sees keys p - W < k <= p (layers/attention/base.py). A
request with c computed tokens asks its next queries at positions >= c, so no query of
it will ever again see a key at or before c - W, and a block wholly before c - W + 1 can
go back to the pool (vLLM's sliding-window manager). Block size 4, W 6, c 13:

    position   0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 ...
    block      0            1            2            3
                            c - W + 1 = 8 ^          ^ c = 13 (the next query)
    first_needed(13) = 8 // 4 = 2: blocks 0 and 1 are out of every future window

Block tables stay positional (slot = table[p // block_size] * block_size + p % block_size),
so a released entry keeps its place and points at the pool's null block
(`BlockPool.null_block`): released blocks are always a request's leading entries.

With any global layer (Gemma keeps some; all layers share one table) every block stays
visible: `FullContextBlocks` is the null object, whose first needed block is always 0.
"""

from __future__ import annotations

from collections.abc import Sequence


class FullContextBlocks:
    """Some layer attends the whole context: every block a request computed stays needed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def first_needed(self, position: int) -> int:
        """The first block a query at `position` or later can see."""
        return 0

    def most_held(self, num_tokens: int) -> int:
        """The most blocks a request holds at once while it computes `num_tokens` tokens'
        KV one token a step (larger chunks are cut to fit the pool: Scheduler._chunk)."""
        return -(-num_tokens // self.block_size)

    def usable_hit(self, block_ids: Sequence[int], null_block: int) -> int:
        """How many leading blocks of a prefix-cache hit a request can take: up to the last
        block boundary before which every block its next queries see is in the cache (the
        tree keeps holes, `null_block`, where it gave blocks of a path back)."""
        for m in range(len(block_ids), 0, -1):
            if null_block not in block_ids[self.first_needed(m * self.block_size):m]:
                return m
        return 0


class SlidingWindowBlocks(FullContextBlocks):
    """Every layer has a window, the largest is `window`: blocks before it can go."""

    def __init__(self, block_size: int, window: int) -> None:
        super().__init__(block_size)
        if window < 1:
            raise ValueError(f"a sliding window covers at least one token, got {window}")
        self.window = window

    def first_needed(self, position: int) -> int:
        return max(0, position - self.window + 1) // self.block_size

    def most_held(self, num_tokens: int) -> int:
        # computing position p needs blocks first_needed(p) .. p // block_size: the blocks
        # that W consecutive positions can touch, at most ceil((W - 1) / block_size) + 1
        return min(super().most_held(num_tokens), -(-(self.window - 1) // self.block_size) + 1)


def shared_window(layer_windows: Sequence[int | None] | None) -> int | None:
    """The window that bounds what any layer sees: the largest, when every layer has one;
    None when some layer (or every one) attends the whole context."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(layer_windows)


def make_window_blocks(block_size: int, window: int | None) -> FullContextBlocks:
    return FullContextBlocks(block_size) if window is None else SlidingWindowBlocks(block_size, window)
