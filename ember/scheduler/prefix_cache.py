"""The prefix cache: a radix tree over token ids at block granularity (SGLang's
RadixAttention), so a request whose prompt starts like an earlier one reuses its KV.

Each node holds a run of whole blocks: `token_ids` (a multiple of block_size) and the
`block_ids` whose KV those tokens produced. A node's children are keyed by the tokens of
their first block. Example, block_size 2, after "a b c d e f" and "a b c d x y":

    root ── [a b | c d] blocks (7, 3) ─┬─ [e f] (4)
                                       └─ [x y] (9)

Rules that keep the accounting exact (`BlockPool`: free + in use + evictable == total):
- A request's blocks that the tree holds are whole nodes along one path from the root:
  matching or inserting into the middle of a node splits it first, and so does the
  scheduler (`split`) where a sliding window lets a request give back the head of its
  path (sliding_window.py). So every block of a node has the same ref count.
- Eviction takes, least recently used first, an idle node (blocks cached, ref count 0)
  with no idle node below it: a leaf goes (its tail blocks first); an interior node, whose
  blocks a window released while requests below still hold theirs, gives its blocks back
  and stays as a hole (its tokens, every block id `pool.null_block`), so the path to the
  blocks below stays; a hole with nothing below it goes too. Every evictable block is
  reached this way. Without windows no hole ever forms: ref counts only grow towards the
  root, so the nodes below an idle node are idle too and leaves go first.
- `match` returns holes as null blocks: a windowed request takes a hit as far as its
  window's blocks are all there (`FullContextBlocks.usable_hit`).
- Requests with a cache_salt share blocks only among themselves: each salt has its own
  tree (`salted`), dropped once eviction empties it.
- A request that computed a block the tree already holds (two requests with one prefix in
  flight at once) swaps its copy for the tree's block, which holds the same KV; one that
  computed a block where the tree has a hole fills the hole.
- A finished request's last, partly filled block is kept as a partial leaf: fewer than
  block_size tokens, one block, keyed by all its tokens (so a whole-block lookup never lands
  on it). A later request whose next tokens begin the same way, after its whole-block hit,
  copies that block, or the cached whole block agreeing longest, into a block of its own
  (`match_partial`) and computes only the rest: a chat's next turn
  recomputes nothing, as a token-granular tree would. A partial leaf goes when eviction takes
  it or a longer block (whole, or partial: a later turn's) that begins with its tokens is
  cached beside it (a copy in flight from it keeps its block until the copying step is
  collected, outside the tree).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Sequence

from ember.scheduler.block_pool import BlockPool
from ember.scheduler.host_tier import HostKVTier, block_hashes

EVICT_BATCH_DIVISOR = 64  # an eviction frees at least 1/64 of the pool (when that much is evictable)


@dataclass(frozen=True)
class MatchResult:
    block_ids: list[int]  # the cached prefix's blocks, in order
    num_tokens: int  # len(block_ids) * block_size


class PrefixCache(ABC):
    """What the scheduler asks of a prefix cache."""

    # told each block id that eviction gives back (a recurrent state's snapshot keyed by it goes)
    on_evict: Callable[[int], None] = staticmethod(lambda block_id: None)

    @abstractmethod
    def match(self, token_ids: Sequence[int], max_blocks: int, salt: str | None = None) -> MatchResult:
        """The longest cached prefix of `token_ids`, at most `max_blocks` blocks. Marks it
        recently used; the caller takes references on the blocks it keeps. Every method
        takes a `salt` (a request's cache_salt): blocks are shared only within one salt."""

    @abstractmethod
    def peek(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """How many leading tokens are cached; changes nothing (for the lpm policy)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: list[int], salt: str | None = None) -> None:
        """Cache the full blocks `block_ids` computed for `token_ids` (len(token_ids) ==
        len(block_ids) * block_size). Where the tree already holds a block for the same
        tokens, `block_ids` is updated in place to it (the caller's copy is freed)."""

    @abstractmethod
    def evict(self, num_blocks: int, hold: bool = False) -> list[int]:
        """Free at least `num_blocks` evictable blocks, least recently used leaves first. With
        `hold`, those the host tier copies out stay in use instead (their copy is in flight)
        until the caller frees them; returns those (else [])."""

    def insert_partial(self, token_ids: Sequence[int], block_ids: list[int], salt: str | None = None) -> None:
        """Cache a finished request's last, partly filled block `block_ids[-1]`, which holds
        the KV of the tokens after the whole blocks `block_ids[:-1]` (already in the tree)."""

    def match_partial(self, token_ids: Sequence[int], num_blocks: int, max_tokens: int,
                      salt: str | None = None) -> tuple[int, int] | None:
        """After a hit of `num_blocks` whole blocks: the cached block (partial or whole) whose
        leading tokens agree longest with the next of `token_ids`, at most `max_tokens` of
        them, as (block id, tokens that agree); None where none agrees. The caller copies it."""
        return None

    def split(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None) -> None:
        """Cut the cached path of `token_ids` after its first `num_blocks` blocks: a request
        lets go of the blocks before that point and keeps those after (sliding window)."""

    def check_integrity(self) -> None:
        """Assert the tree's invariants (tests)."""


class NullPrefixCache(PrefixCache):
    """Prefix caching off: nothing is ever cached or matched."""

    def match(self, token_ids: Sequence[int], max_blocks: int, salt: str | None = None) -> MatchResult:
        return MatchResult([], 0)

    def peek(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        return 0

    def insert(self, token_ids: Sequence[int], block_ids: list[int], salt: str | None = None) -> None:
        pass

    def evict(self, num_blocks: int, hold: bool = False) -> list[int]:
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
        self.salted: dict[str, RadixNode] = {}  # each cache_salt's own tree
        self._clock = 0
        pool.evictor = self
        self.host: HostKVTier | None = None  # where evicted blocks go instead of away (host_tier.py)

    # -- lookups --------------------------------------------------------------------------

    def _root(self, salt: str | None) -> RadixNode:
        if salt is None:
            return self.root
        if salt not in self.salted:
            self.salted[salt] = RadixNode((), [])
        return self.salted[salt]

    def match(self, token_ids: Sequence[int], max_blocks: int, salt: str | None = None) -> MatchResult:
        blocks: list[int] = []
        for child, num_blocks in self._walk(token_ids, max_blocks, salt):
            if num_blocks < len(child.block_ids):
                child = self._split(child, num_blocks)
            self._touch(child)
            blocks += child.block_ids
        return MatchResult(blocks, len(blocks) * self.block_size)

    def peek(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        return sum(n for _, n in self._walk(token_ids, len(token_ids) // self.block_size, salt)) * self.block_size

    def _walk(self, token_ids: Sequence[int], max_blocks: int, salt: str | None):
        """Yield (node, number of its leading blocks that match) along the matching path."""
        bs, i = self.block_size, 0
        node = self.root if salt is None else self.salted.get(salt, _EMPTY)
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

    def match_partial(self, token_ids: Sequence[int], num_blocks: int, max_tokens: int,
                      salt: str | None = None) -> tuple[int, int] | None:
        bs, start = self.block_size, num_blocks * self.block_size
        node = self.root if salt is None else self.salted.get(salt, _EMPTY)
        candidates = None
        for child, n in self._walk(token_ids, num_blocks, salt):
            node = child
            if n < len(child.block_ids):  # the path goes on inside this node: its next block only
                candidates = [(child, n)]
        want = tuple(token_ids[start:start + min(bs, max_tokens)])
        if candidates is None:
            exact = node.children.get(want)  # a child keyed by exactly these tokens: none agrees longer
            candidates = [(exact, 0)] if exact is not None and self._live(exact) else \
                [(c, 0) for c in node.children.values()]
        best, best_len = None, 0
        for child, n in candidates:
            agree = _common_length(child.token_ids[n * bs:(n + 1) * bs], want)
            if agree > best_len and self._live(child):
                best, best_len = (child, n), agree
        if best is None:
            return None
        node, n = best
        if n:
            self._split(node, n)  # `node` now begins with the block
        if len(node.block_ids) > 1:
            node = self._split(node, 1)  # the caller holds the block: a node of its own (one ref count a node)
        self._touch(node)
        block = node.block_ids[0]
        return block, best_len

    # -- changes --------------------------------------------------------------------------

    def insert_partial(self, token_ids: Sequence[int], block_ids: list[int], salt: str | None = None) -> None:
        bs = self.block_size
        full = len(block_ids) - 1
        assert 0 < len(token_ids) - full * bs < bs
        node, walked = self._root(salt), 0
        for child, n in self._walk(token_ids, full, salt):
            node, walked = child, walked + n
        if walked < full or (full and node.block_ids[-1] != block_ids[full - 1]):
            return  # the whole blocks before it are not the tree's path (not expected: the caller holds them)
        tail = tuple(token_ids[full * bs:])
        if any(c.token_ids[:len(tail)] == tail for c in node.children.values()):
            return  # a cached block already begins with these tokens
        leaf = self._add(node, tail, [block_ids[full]])
        self.pool.mark_cached(block_ids[full])
        self._touch(leaf)

    def split(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None) -> None:
        for child, n in self._walk(token_ids, num_blocks, salt):
            if n < len(child.block_ids):
                self._split(child, n)

    def insert(self, token_ids: Sequence[int], block_ids: list[int], salt: str | None = None) -> None:
        """Leading null entries of `block_ids` are blocks the caller gave back (its window
        passed them): the tree keeps what it holds there, or a hole for their tokens."""
        bs, null = self.block_size, self.pool.null_block
        assert len(token_ids) == len(block_ids) * bs
        own = next((j for j, b in enumerate(block_ids) if b != null), len(block_ids))  # the caller's from here
        if own == len(block_ids):
            return
        node, i = self._root(salt), 0
        for child, n in self._walk(token_ids, len(block_ids), salt):
            if n < len(child.block_ids):
                child = self._split(child, n)
            if i < own < i + n:  # the caller holds only this node's tail: cut there
                self._split(child, own - i)  # `child` is now the lower part
                i, n = own, i + n - own
            if i >= own:
                self._adopt(child, block_ids, i)
                self._touch(child)
            node, i = child, i + n
        if i < own:  # the tree gave back the blocks the caller gave back, and their path: a hole keeps it
            node = self._add(node, token_ids[i * bs:own * bs], [null] * (own - i))
            i = own
        if i < len(block_ids):
            leaf = self._add(node, token_ids[i * bs:], block_ids[i:])
            for b in leaf.block_ids:
                self.pool.mark_cached(b)
            self._touch(leaf)

    def _adopt(self, node: RadixNode, block_ids: list[int], i: int) -> None:
        """The caller computed `node`'s blocks as block_ids[i:]: a hole takes the caller's;
        where the tree holds its own copy, the caller's is freed and replaced in place."""
        if node.block_ids[0] == self.pool.null_block:
            node.block_ids = block_ids[i:i + len(node.block_ids)]
            for b in node.block_ids:
                self.pool.mark_cached(b)
            return
        for j, cached in enumerate(node.block_ids):
            if block_ids[i + j] != cached:  # computed twice: keep the tree's copy
                self.pool.share([cached])
                self.pool.free([block_ids[i + j]])
                block_ids[i + j] = cached

    def _add(self, parent: RadixNode, token_ids: Sequence[int], block_ids: list[int]) -> RadixNode:
        node = RadixNode(tuple(token_ids), block_ids, parent=parent)
        first = node.token_ids[:self.block_size]
        # partial leaves this block begins like go: every lookup they would answer, it answers as
        # well (a request that went on from a tail leaves that tail behind; a copy in flight holds its source)
        for key, leaf in list(parent.children.items()):
            if len(key) < len(first) and first[:len(key)] == key and len(key) < self.block_size:
                del parent.children[key]
                self.pool.uncache(leaf.block_ids[0])
                self.on_evict(leaf.block_ids[0])
        parent.children[first] = node
        return node

    def evict(self, num_blocks: int, hold: bool = False) -> list[int]:
        # finding the candidates walks the whole tree: once the pool is full of cached blocks
        # every allocation evicts, so free a batch at a time to walk it less often
        num_blocks = min(max(num_blocks, self.pool.num_blocks // EVICT_BATCH_DIVISOR), self.pool.num_evictable)
        idle_below: dict[RadixNode, int] = {}  # idle nodes under each node
        candidates, held = [], []
        for node in reversed(self._nodes()):  # children before their parents
            idle_below[node] = sum(idle_below[c] + self._idle(c) for c in node.children.values())
            if self._idle(node) and not idle_below[node]:
                candidates.append((node.last_access, id(node), node))
        heapq.heapify(candidates)
        while num_blocks > 0:
            _, _, node = heapq.heappop(candidates)  # an IndexError here means the pool's count is wrong
            k = len(node.block_ids) if node.children else min(num_blocks, len(node.block_ids))
            if self.host is not None and len(node.token_ids) >= self.block_size:  # (not a partial leaf)
                for h, b in zip(self._chain_hashes(node)[-k:], node.block_ids[-k:]):
                    if self.host.offload(h, b) and hold:
                        self.pool.share([b])  # in use until the caller frees it: not reused mid-copy
                        held.append(b)
            for b in reversed(node.block_ids[-k:]):
                self.pool.uncache(b)
                self.on_evict(b)
            num_blocks -= k
            if k < len(node.block_ids):
                del node.block_ids[-k:]
                node.token_ids = node.token_ids[:len(node.block_ids) * self.block_size]
                break
            parent = node.parent
            if node.children:
                node.block_ids = [self.pool.null_block] * k
            else:
                del parent.children[node.token_ids[:self.block_size]]
                while parent.parent is not None and not parent.children and not self._live(parent):
                    del parent.parent.children[parent.token_ids[:self.block_size]]  # a hole with nothing below
                    parent = parent.parent
            while parent.parent is not None:  # up to its tree's root
                idle_below[parent] -= 1
                if self._idle(parent) and not idle_below[parent]:
                    heapq.heappush(candidates, (parent.last_access, id(parent), parent))
                parent = parent.parent
        self.salted = {salt: root for salt, root in self.salted.items() if root.children}  # emptied salts go
        return held

    def _chain_hashes(self, node: RadixNode) -> list[int]:
        """host_tier.block_hashes of each block of `node`, from its tree's root."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        salt = next((s for s, root in self.salted.items() if root is node), None)
        tokens = [t for n in reversed(path) for t in n.token_ids]
        hashes = block_hashes(tokens, self.block_size, len(tokens) // self.block_size, salt)
        return hashes[len(hashes) - len(path[0].block_ids):]

    def _live(self, node: RadixNode) -> bool:
        return node.block_ids[0] != self.pool.null_block

    def _idle(self, node: RadixNode) -> bool:
        """Holds cached blocks nobody uses: evictable."""
        return self._live(node) and self.pool.ref_counts[node.block_ids[0]] == 0

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
        out, stack = [], [n for root in (self.root, *self.salted.values()) for n in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # -- checks ---------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(n.block_ids) for n in self._nodes() if self._live(n))

    def check_integrity(self) -> None:
        bs, ref = self.block_size, self.pool.ref_counts
        seen: set[int] = set()
        for node in self._nodes():
            partial_leaf = len(node.block_ids) == 1 and 0 < len(node.token_ids) < bs and not node.children
            assert node.block_ids and (partial_leaf or len(node.token_ids) == len(node.block_ids) * bs), \
                "a node holds partial blocks"
            assert node.parent.children[node.token_ids[:bs]] is node, "a node is not under its key"
            if not self._live(node):
                assert set(node.block_ids) == {self.pool.null_block}, f"a hole holds blocks {node.block_ids}"
                assert node.children, "a hole with nothing below it"
                continue
            counts = {ref[b] for b in node.block_ids}
            assert len(counts) == 1, f"blocks {node.block_ids} of one node have ref counts {counts}"
            for b in node.block_ids:
                assert self.pool.cached[b] and b not in seen, f"block {b} is cached twice or not marked"
                seen.add(b)
        assert len(seen) == sum(self.pool.cached), "the pool marks blocks cached that the tree lacks"


def _common_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the common start of two tuples, by bisection over slices compared in C (a
    token-by-token loop grew with every token a long match had)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_EMPTY = RadixNode((), [])  # the root of a salt nothing is cached under (never written to)


def make_prefix_cache(enabled: bool, pool: BlockPool, block_size: int) -> PrefixCache:
    return RadixPrefixCache(pool, block_size) if enabled else NullPrefixCache()
