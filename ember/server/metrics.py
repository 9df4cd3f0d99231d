"""Prometheus metrics under vLLM's names with the `ember:` prefix, label `model_name`.

The engine core's numbers (read from `AsyncEngine.current_stats()`, its last EngineStats, at
scrape time):
    gauges num_requests_running, num_requests_waiting, kv_cache_usage_perc (a fraction, 1 = full);
    counters num_preemptions_total, prefix_cache_queries_total, prefix_cache_hits_total (in
    tokens), and with speculative decoding spec_decode_num_drafts_total,
    spec_decode_num_draft_tokens_total, spec_decode_num_accepted_tokens_total,
    spec_decode_num_accepted_tokens_per_pos_total{position}, and with --kv-offload-gib
    kv_offload_hits_total (tokens), kv_offload_bytes_total{direction}; with a host tier or swap
    the summary kv_offload_load_seconds (count: steps that copied KV in from host memory, sum:
    those copies' seconds, timed on the copy stream on CUDA)
The API process's (fed by `PrometheusStatLogger.record()` on the engine thread after every
step; prometheus_client is thread-safe):
    counters prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason}
    (stop, length, abort: the client left or the server stopped it, error: it failed in the
    engine); histograms (seconds) time_to_first_token, inter_token_latency,
    e2e_request_latency, request_queue_time, request_prefill_time, request_decode_time

Each server has its own registry, so several can live in one process. With several API
processes (`--api-server-count`) the API side's numbers are summed over them (ServerMetrics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ember.engine.stats import EngineStats, IterationStats

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0]


class _CoreCollector(Collector):
    """The engine core's numbers at scrape time, from its last EngineStats: the state gauges and
    its counters since start (the same in every API process, so they are never summed)."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        s = self.stats() or EngineStats()
        m = self.model_name
        for name, doc, value in [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).", s.kv_cache_usage),
        ]:
            g = GaugeMetricFamily(f"ember:{name}", doc, labels=["model_name"])
            g.add_metric([m], value)
            yield g
        counters = [("num_preemptions", "Preemptions.", s.num_preemptions),
                    ("prefix_cache_queries", "Tokens looked up in the prefix cache.", s.prefix_cache_queries),
                    ("prefix_cache_hits", "Tokens found in the prefix cache.", s.prefix_cache_hits)]
        if s.spec_num_drafts:  # speculative decoding
            counters += [
                ("spec_decode_num_drafts", "Speculative decoding: verifying steps of a request.", s.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted.", s.spec_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Speculative decoding: drafts accepted.",
                 s.spec_num_accepted_tokens)]
        if s.host_hit_tokens:
            counters.append(("kv_offload_hits", "Prompt tokens loaded back from the host tier (--kv-offload-gib).",
                             s.host_hit_tokens))
        for name, doc, value in counters:
            c = CounterMetricFamily(f"ember:{name}", doc, labels=["model_name"])
            c.add_metric([m], value)
            yield c
        if s.spec_accepted_per_position:
            c = CounterMetricFamily("ember:spec_decode_num_accepted_tokens_per_pos",
                                    "Speculative decoding: drafts accepted at each draft position.",
                                    labels=["model_name", "position"])
            for position, n in enumerate(s.spec_accepted_per_position):
                c.add_metric([m, str(position)], n)
            yield c
        moved = [(d, n) for d, n in (("to_host", s.host_bytes_to_host), ("to_device", s.host_bytes_to_device)) if n]
        if moved:
            c = CounterMetricFamily("ember:kv_offload_bytes", "Bytes of KV moved between the device pool and the host "
                                    "tier.", labels=["model_name", "direction"])
            for direction, n in moved:
                c.add_metric([m, direction], n)
            yield c
        if s.kv_loads:
            summary = SummaryMetricFamily("ember:kv_offload_load_seconds", "Copies of KV blocks in from host memory "
                                          "(host-tier hits, swap-ins): a step's, in seconds.", labels=["model_name"])
            summary.add_metric([m], count_value=s.kv_loads, sum_value=s.kv_load_seconds)
            yield summary


class PrometheusStatLogger:
    """Counters and histograms, fed after every engine step."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"ember:{name}", doc, ["model_name", *labels], registry=registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"ember:{name}", doc, ["model_name"], buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that got their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.success = counter("request_success", "Requests that finished, by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a sample.",
                             _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", _REQUEST_BUCKETS)
        for reason in ("stop", "length", "abort", "error"):  # present from the start, at 0
            self.success.labels(model_name, reason)

    def record(self, stats: EngineStats, it: IterationStats) -> None:
        m = self.model_name
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.labels(m).observe(t)
        for t in it.inter_token_latencies:
            self.itl.labels(m).observe(t)
        for f in it.finished:
            self.success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            self.queue.labels(m).observe(f.queue_time)
            self.prefill.labels(m).observe(f.prefill_time)
            self.decode.labels(m).observe(f.decode_time)


class ServerMetrics:
    """One server's /metrics. With several API processes (`multiprocess`: PROMETHEUS_MULTIPROC_DIR
    set before they started) every process renders the same totals: its counters and histograms
    summed over the processes' files by prometheus_client, killed ones included (a total never
    goes back), and the core's numbers from its last EngineStats."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None], multiprocess: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.stat_logger = PrometheusStatLogger(self.registry, model_name)
        for metric in (self.stat_logger.prompt_tokens, self.stat_logger.generation_tokens, self.stat_logger.ttft,
                       self.stat_logger.itl, self.stat_logger.e2e, self.stat_logger.queue, self.stat_logger.prefill,
                       self.stat_logger.decode):
            metric.labels(model_name)  # present from the start, at 0
        if multiprocess:  # render the sum of every process's files, not this process's own values
            from prometheus_client.multiprocess import MultiProcessCollector

            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry)
        self.registry.register(_CoreCollector(model_name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
