"""The flags of `ember router` (light: the HTTP parts load when it runs)."""

from __future__ import annotations

import argparse

from ember.router.policy import CacheAwarePolicy, PolicyConfig


def add_router_args(parser: argparse.ArgumentParser) -> None:
    p = PolicyConfig()
    parser.add_argument("--worker", action="append", required=True, metavar="URL",
                        help="an `ember serve` (or any OpenAI-compatible server) to route to, e.g. "
                             "http://127.0.0.1:8001; give it once per worker")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", choices=["cache-aware", "round-robin"], default="cache-aware",
                        help="round-robin: each healthy worker in turn, whatever the text (a baseline)")
    parser.add_argument("--cache-threshold", type=float, default=p.cache_threshold,
                        help="send a request to the worker holding the longest prefix of its text when that "
                             "prefix is at least this share of the text; else to the least loaded worker")
    parser.add_argument("--balance-abs-threshold", type=int, default=p.balance_abs_threshold,
                        help="loads are imbalanced (every request goes to the least loaded worker) when the "
                             "most and least requests in flight differ by more than this ...")
    parser.add_argument("--balance-rel-threshold", type=float, default=p.balance_rel_threshold,
                        help="... and the most is more than this times the least")
    parser.add_argument("--max-tree-chars", type=int, default=p.max_tree_chars,
                        help="characters of sent text remembered per worker (least recently used go first)")
    parser.add_argument("--health-check-interval", type=float, default=5.0,
                        help="seconds between GET /health of every worker")
    parser.add_argument("--health-check-timeout", type=float, default=5.0,
                        help="a worker whose /health takes longer hangs: it is taken out, its requests fail")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run_router_from_args(ns: argparse.Namespace) -> None:
    from ember.router.app import RouterConfig, run_router

    policy = PolicyConfig(ns.cache_threshold, ns.balance_abs_threshold, ns.balance_rel_threshold, ns.max_tree_chars,
                          round_robin=ns.policy == "round-robin")
    config = RouterConfig(tuple(ns.worker), policy, ns.health_check_interval, ns.health_check_timeout)
    CacheAwarePolicy(list(config.workers), policy)  # a bad worker list fails here, before listening
    run_router(config, ns.host, ns.port, ns.uvicorn_log_level)
