"""The cache-aware routing policy of `ember router`, pure (no I/O): which worker gets a request.

Each worker has an approximate prefix tree of the text the router sent it (its KV prefix
cache holds roughly the same prefixes). A request goes to the worker whose tree matches the
longest prefix of its text when that match covers at least `cache_threshold` of the text;
otherwise to the least loaded worker (fewest requests in flight; among equals the one with
the smallest tree, so new prefixes spread over the workers). When the loads are imbalanced
(max - min > `balance_abs_threshold` and max > `balance_rel_threshold` x min) every request
goes to the least loaded worker. Ties go to the worker listed first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    edge: str  # the characters on the edge from the parent to this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # keyed by the first character of their edge
    last_used: int = 0


class PrefixTree:
    """A radix tree of strings with least-recently-used eviction once it holds more than
    `max_chars` characters (whole leaves go first, as a worker's prefix cache evicts)."""

    def __init__(self, max_chars: int) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self.root = _Node("", None)
        self.size = 0  # characters stored (the sum of the edge lengths)
        self._clock = 0

    def match(self, text: str) -> int:
        """How many leading characters of `text` the tree holds."""
        node, matched = self.root, 0
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = _common_prefix(child.edge, text, matched)
            matched += common
            if common < len(child.edge):
                break
            node = child
        return matched

    def insert(self, text: str) -> None:
        """Add `text`, mark its path most recently used, and evict down to `max_chars`."""
        self._clock += 1
        node, at = self.root, 0
        node.last_used = self._clock
        while at < len(text):
            child = node.children.get(text[at])
            if child is None:
                leaf = _Node(text[at:], node, last_used=self._clock)
                node.children[text[at]] = leaf
                self.size += len(leaf.edge)
                break
            common = _common_prefix(child.edge, text, at)
            if common < len(child.edge):  # split the edge: the shared part becomes a node of its own
                middle = _Node(child.edge[:common], node, last_used=self._clock)
                node.children[text[at]] = middle
                child.edge, child.parent = child.edge[common:], middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = self._clock
            at += common
            node = child
        self._evict()

    def clear(self) -> None:
        self.root, self.size = _Node("", None), 0

    def _evict(self) -> None:
        if self.size <= self.max_chars:
            return
        leaves = [(n.last_used, i, n) for i, n in enumerate(self._leaves())]
        heapq.heapify(leaves)
        tie = len(leaves)
        while self.size > self.max_chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                tie += 1
                heapq.heappush(leaves, (parent.last_used, tie, parent))

    def _leaves(self) -> list[_Node]:
        out, todo = [], [self.root]
        while todo:
            node = todo.pop()
            if node.children:
                todo.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out


def _common_prefix(edge: str, text: str, start: int) -> int:
    """The length of the common prefix of `edge` and text[start:]."""
    n = min(len(edge), len(text) - start)
    i = 0
    while i < n and edge[i] == text[start + i]:
        i += 1
    return i


@dataclass(frozen=True)
class PolicyConfig:
    cache_threshold: float = 0.5  # the share of a request's text a worker must hold to get it for its cache
    balance_abs_threshold: int = 16  # loads are imbalanced when max - min in flight exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this x min
    max_tree_chars: int = 1 << 24  # characters each worker's tree keeps before evicting
    round_robin: bool = False  # ignore text and load: each healthy worker in turn (the baseline)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")


class NoHealthyWorker(Exception):
    """Every worker is out of rotation."""


@dataclass(eq=False)
class WorkerState:
    url: str
    tree: PrefixTree
    healthy: bool = True
    in_flight: int = 0
    routed: int = 0  # requests sent to this worker since the router started
    cache_routed: int = 0  # of which were sent for the prefix match


class CacheAwarePolicy:
    """Picks a worker for each request's text and keeps the count of requests in flight:
    call `route` before sending a request and `finished` when its answer is done."""

    def __init__(self, urls: list[str], config: PolicyConfig | None = None) -> None:
        if not urls:
            raise ValueError("the router needs at least one worker: give --worker URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a worker is listed twice: {urls}")
        self.config = config or PolicyConfig()
        self.workers = [WorkerState(url, PrefixTree(self.config.max_tree_chars)) for url in urls]
        self._by_url = {w.url: w for w in self.workers}
        self._turn = 0  # round_robin: the next worker's index

    def worker(self, url: str) -> WorkerState:
        return self._by_url[url]

    def route(self, text: str, exclude: frozenset[str] = frozenset()) -> WorkerState:
        """The worker for a request with this text (not one in `exclude`); counts it in flight."""
        candidates = [w for w in self.workers if w.healthy and w.url not in exclude]
        if not candidates:
            raise NoHealthyWorker("no worker is healthy")
        chosen, for_cache = self._choose(text, candidates)
        chosen.tree.insert(text)
        chosen.in_flight += 1
        chosen.routed += 1
        chosen.cache_routed += for_cache
        return chosen

    def finished(self, worker: WorkerState) -> None:
        worker.in_flight -= 1
        assert worker.in_flight >= 0, f"{worker.url} finished more requests than it was sent"

    def mark_down(self, worker: WorkerState) -> None:
        """Out of rotation; what it cached is forgotten (a restarted worker has an empty cache)."""
        worker.healthy = False
        worker.tree.clear()

    def mark_up(self, worker: WorkerState) -> None:
        worker.healthy = True

    def _choose(self, text: str, candidates: list[WorkerState]) -> tuple[WorkerState, bool]:
        if self.config.round_robin:
            ring = self.workers[self._turn:] + self.workers[:self._turn]
            chosen = next(w for w in ring if w in candidates)
            self._turn = (self.workers.index(chosen) + 1) % len(self.workers)
            return chosen, False
        loads = [w.in_flight for w in candidates]
        lo, hi = min(loads), max(loads)
        c = self.config
        if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
            return min(candidates, key=lambda w: w.in_flight), False
        if text:
            matches = [w.tree.match(text) for w in candidates]
            best = max(matches)
            if best > 0 and best / len(text) >= c.cache_threshold:
                # the longest match; among equal matches the least loaded
                i = min(range(len(candidates)), key=lambda i: (-matches[i], candidates[i].in_flight))
                return candidates[i], True
        return min(candidates, key=lambda w: (w.in_flight, w.tree.size)), False
