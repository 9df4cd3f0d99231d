"""What the engine thread reports: a state snapshot after every pass (`EngineStats`) and
what one step did (`IterationStats`), handed to stat loggers (Prometheus, the log line).

Per-request times are those of `Request` (time.monotonic()), as vLLM defines them:

    arrival ── queued ──> first scheduled ── prefill ──> first token ── decode ──> finished
    |<──────────────── time to first token ────────────>|
    |<─────────────────────────── end-to-end latency ──────────────────────────>|
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("ember.stats")


@dataclass(frozen=True)
class EngineStats:
    """The engine's state, published after every pass (one attribute assignment, so any
    thread may read it)."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue, plus those not yet handed to it
    num_kv_blocks: int = 0
    num_kv_blocks_in_use: int = 0
    num_preemptions: int = 0  # since start
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found
    # speculative decoding, since start (scheduler.SpecDecodeCounts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # the host tier under the prefix cache (--kv-offload-gib), since start
    host_hit_tokens: int = 0  # prompt tokens it gave back at admission
    host_bytes_to_host: int = 0  # evicted blocks kept
    host_bytes_to_device: int = 0  # kept blocks loaded back
    # steps that copied KV in from host memory (host-tier hits, swap-ins) and those copies' seconds
    kv_loads: int = 0
    kv_load_seconds: float = 0.0
    sleep_level: int = 0  # 0: awake; 1, 2: asleep (/sleep), so every API process refuses generation

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_in_use / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" (aborted: its client left) | "error" (failed)
    num_prompt_tokens: int
    num_generation_tokens: int  # all n samples
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float


@dataclass
class IterationStats:
    """What one engine step did."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0
    spec_num_drafts: int = 0  # speculative decoding: verifying steps of a request
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    host_hit_tokens: int = 0
    host_bytes_to_host: int = 0
    host_bytes_to_device: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Called on the engine thread after each step: keep it cheap, never raise."""

    def record(self, stats: EngineStats, iteration: IterationStats) -> None: ...


class LoggingStatLogger:
    """A line in the log every `interval` seconds while the engine works: prompt and
    generation throughput, running, waiting, KV use, prefix-cache hit rate, preemptions, and with
    speculative decoding the mean accepted length (tokens a verifying step appends) and the
    drafts' acceptance rate. `label` starts the line (with several API processes: which one; its
    throughput is its own requests', the state the core's)."""

    def __init__(self, interval: float = 5.0, label: str = "") -> None:
        self.interval = interval
        self.label = label
        self._start = self._last = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._queries = self._hits = 0
        self._drafts = self._draft_tokens = self._accepted = 0

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        now = time.monotonic()
        if now - self._last > self.interval:  # idle since the last step: a new window starts now
            self._reset(now)
        self._last = now
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        self._preemptions += iteration.num_preemptions
        self._queries += iteration.prefix_cache_queries
        self._hits += iteration.prefix_cache_hits
        self._drafts += iteration.spec_num_drafts
        self._draft_tokens += iteration.spec_num_draft_tokens
        self._accepted += iteration.spec_num_accepted_tokens
        if now - self._start < self.interval:
            return
        elapsed = now - self._start
        spec = "" if not self._drafts else (
            f", mean accepted length: {1 + self._accepted / self._drafts:.2f}, draft acceptance rate: "
            f"{100 * self._accepted / self._draft_tokens:.1f}%")
        logger.info("%sprompt: %.1f tok/s, generation: %.1f tok/s, running: %d, waiting: %d, KV cache: %.1f%%, "
                    "prefix cache hit rate: %.1f%%, preemptions: %d%s", self.label, self._prompt_tokens / elapsed,
                    self._generation_tokens / elapsed, stats.num_running, stats.num_waiting,
                    100 * stats.kv_cache_usage, 100 * self._hits / self._queries if self._queries else 0.0,
                    self._preemptions, spec)
        self._reset(now)

    def _reset(self, now: float) -> None:
        self._start, self._prompt_tokens, self._generation_tokens, self._preemptions = now, 0, 0, 0
        self._queries = self._hits = 0
        self._drafts = self._draft_tokens = self._accepted = 0
