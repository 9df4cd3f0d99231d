"""The prefix cache: a radix tree over token ids at block granularity (SGLang's
RadixAttention), so a request whose prompt starts like an earlier one reuses its KV.

Each node holds a run of whole blocks: `token_ids` (a multiple of block_size) and the
`block_ids` whose KV those tokens produced. A node's children are keyed by the tokens of
their first block. Example, block_size 2, after "a b c d e f" and "a b c d x y":

    root ── [a b | c d] blocks (7, 3) ─┬─ [e f] (4)
                                       └─ [x y] (9)

Rules that keep the accounting exact (`BlockPool`: free + in use + evictable == total):
- A request's blocks that the tree holds are always whole nodes along one path from the
  root: matching or inserting into the middle of a node splits it first.
- So every block of a node has the same ref count, and a node's count is at least its
  children's: a node with ref count 0 has only such descendants, and evicting leaves
  first (least recently used first, tail blocks of a leaf first) can reach every
  evictable block.
- A request that computed a block the tree already holds (two requests with one prefix in
  flight at once) swaps its copy for the tree's block, which holds the same KV.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from ember.scheduler.block_pool import BlockPool

EVICT_BATCH_DIVISOR = 64  # an eviction frees at least 1/64 of the pool (when that much is evictable)


@dataclass(frozen=True)
class MatchResult:
    block_ids: list[int]  # the cached prefix's blocks, in order
    num_tokens: int  # len(block_ids) * block_size


class PrefixCache(ABC):
    """What the scheduler asks of a prefix cache."""

    @abstractmethod
    def match(self, token_ids: Sequence[int], max_blocks: int) -> MatchResult:
        """The longest cached prefix of `token_ids`, at most `max_blocks` blocks. Marks it
        recently used; the caller takes references on the blocks it keeps."""

    @abstractmethod
    def peek(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens are cached; changes nothing (for the lpm policy)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> None:
        """Cache the full blocks `block_ids` computed for `token_ids` (len(token_ids) ==
        len(block_ids) * block_size). Where the tree already holds a block for the same
        tokens, `block_ids` is updated in place to it (the caller's copy is freed)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> None:
        """Free at least `num_blocks` evictable blocks, least recently used leaves first."""

    def check_integrity(self) -> None:
        """Assert the tree's invariants (tests)."""


class NullPrefixCache(PrefixCache):
    """Prefix caching off: nothing is ever cached or matched."""

    def match(self, token_ids: Sequence[int], max_blocks: int) -> MatchResult:
        return MatchResult([], 0)

    def peek(self, token_ids: Sequence[int]) -> int:
        return 0

    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> None:
        pass

    def evict(self, num_blocks: int) -> None:
        raise AssertionError("nothing is cached, so nothing can be evicted")


@dataclass(eq=False)
class RadixNode:
    token_ids: tuple[int, ...]
    block_ids: list[int]
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0  # a tick of the cache's clock


class RadixPrefixCache(PrefixCache):
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.root = RadixNode((), [])
        self._clock = 0
        pool.evictor = self

    # -- lookups --------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_blocks: int) -> MatchResult:
        blocks: list[int] = []
        for child, num_blocks in self._walk(token_ids, max_blocks):
            if num_blocks < len(child.block_ids):
                child = self._split(child, num_blocks)
            self._touch(child)
            blocks += child.block_ids
        return MatchResult(blocks, len(blocks) * self.block_size)

    def peek(self, token_ids: Sequence[int]) -> int:
        return sum(n for _, n in self._walk(token_ids, len(token_ids) // self.block_size)) * self.block_size

    def _walk(self, token_ids: Sequence[int], max_blocks: int):
        """Yield (node, number of its leading blocks that match) along the matching path."""
        bs, node, i = self.block_size, self.root, 0
        while i < max_blocks:
            child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                return
            n = 1
            while (n < len(child.block_ids) and i + n < max_blocks
                   and tuple(token_ids[(i + n) * bs:(i + n + 1) * bs]) == child.token_ids[n * bs:(n + 1) * bs]):
                n += 1
            whole = n == len(child.block_ids)
            yield child, n  # the caller may split `child` now
            if not whole:
                return
            node, i = child, i + n

    # -- changes --------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], block_ids: list[int]) -> None:
        bs = self.block_size
        assert len(token_ids) == len(block_ids) * bs
        node, i = self.root, 0
        for child, n in self._walk(token_ids, len(block_ids)):
            if n < len(child.block_ids):
                child = self._split(child, n)
            for j, cached in enumerate(child.block_ids):
                if block_ids[i + j] != cached:  # computed twice: keep the tree's copy
                    self.pool.share([cached])
                    self.pool.free([block_ids[i + j]])
                    block_ids[i + j] = cached
            self._touch(child)
            node, i = child, i + n
        if i < len(block_ids):
            leaf = RadixNode(tuple(token_ids[i * bs:]), block_ids[i:], parent=node)
            node.children[leaf.token_ids[:bs]] = leaf
            for b in leaf.block_ids:
                self.pool.mark_cached(b)
            self._touch(leaf)

    def evict(self, num_blocks: int) -> None:
        # finding the leaves walks the whole tree: once the pool is full of cached blocks
        # every allocation evicts, so free a batch at a time to walk it less often
        num_blocks = min(max(num_blocks, self.pool.num_blocks // EVICT_BATCH_DIVISOR), self.pool.num_evictable)
        ref = self.pool.ref_counts
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and ref[n.block_ids[-1]] == 0]
        heapq.heapify(leaves)
        while num_blocks > 0:
            _, _, leaf = heapq.heappop(leaves)  # an IndexError here means the pool's count is wrong
            k = min(num_blocks, len(leaf.block_ids))
            for b in reversed(leaf.block_ids[-k:]):
                self.pool.uncache(b)
            num_blocks -= k
            if k < len(leaf.block_ids):
                del leaf.block_ids[-k:]
                leaf.token_ids = leaf.token_ids[:len(leaf.block_ids) * self.block_size]
                break
            parent = leaf.parent
            del parent.children[leaf.token_ids[:self.block_size]]
            if parent is not self.root and not parent.children and ref[parent.block_ids[-1]] == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))

    def _split(self, node: RadixNode, num_blocks: int) -> RadixNode:
        """Cut `node` after its first `num_blocks` blocks; return the new upper part. The
        lower part stays the same object, so nothing that points at it goes stale."""
        cut = num_blocks * self.block_size
        upper = RadixNode(node.token_ids[:cut], node.block_ids[:num_blocks], node.parent,
                          last_access=node.last_access)
        node.parent.children[upper.token_ids[:self.block_size]] = upper
        node.token_ids, node.block_ids, node.parent = node.token_ids[cut:], node.block_ids[num_blocks:], upper
        upper.children[node.token_ids[:self.block_size]] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        node.last_access = self._clock

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # -- checks ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(n.block_ids) for n in self._nodes())

    def check_integrity(self) -> None:
        bs, ref = self.block_size, self.pool.ref_counts
        seen: set[int] = set()
        for node in self._nodes():
            assert node.block_ids and len(node.token_ids) == len(node.block_ids) * bs, "a node holds partial blocks"
            assert node.parent.children[node.token_ids[:bs]] is node, "a node is not under its key"
            counts = {ref[b] for b in node.block_ids}
            assert len(counts) == 1, f"blocks {node.block_ids} of one node have ref counts {counts}"
            if node.parent is not self.root:
                assert ref[node.parent.block_ids[-1]] >= ref[node.block_ids[0]], "a node is used more than its parent"
            for b in node.block_ids:
                assert self.pool.cached[b] and b not in seen, f"block {b} is cached twice or not marked"
                seen.add(b)
        assert len(seen) == sum(self.pool.cached), "the pool marks blocks cached that the tree lacks"


def make_prefix_cache(enabled: bool, pool: BlockPool, block_size: int) -> PrefixCache:
    return RadixPrefixCache(pool, block_size) if enabled else NullPrefixCache()
