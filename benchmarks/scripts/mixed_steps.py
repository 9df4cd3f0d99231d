"""Where a mixed step's time goes (a prefill chunk over a cached prefix beside decoding rows),
the steps of vLLM's prefix_repetition workload, in the engine alone (no HTTP).

    python3 benchmarks/scripts/mixed_steps.py benchmarks/configs/llama-3.1-8b steps load [--rate 32]

steps: D requests over one shared prefix decode; then, --repeat times, a decode step and a
mixed step (one new request: the cached prefix + its own --suffix-len tokens) are timed with
a device sync on each side (no step left in flight), and the mixed step's kernels are listed
from torch.profiler, in µs per step.

--mixed-graph-max-tokens 0 runs mixed steps eager (the A/B of piecewise graphs).

load: --num-requests requests over --num-prefixes shared prefixes, Poisson arrivals at --rate
per second of wall time, fed to the engine core between its steps (as a server would); TTFT
and TPOT from the step timestamps, and the mean step time of decode-only and mixed steps.
"""

import argparse
import time
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from ember import LLM
from ember.request import Request
from ember.sampling_params import SamplingParams


def tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1000, vocab - 1000, size=n).tolist()


def kinds(core) -> tuple[int, int]:
    """(decode rows, prefill tokens) of the step launched last."""
    plan = core.in_flight[-1].plan if core.in_flight else None
    if plan is None:
        return 0, 0
    decodes = sum(1 for c in plan.chunks if c.num_new_tokens == 1)
    return decodes, plan.num_tokens - decodes


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(core) -> float:
    sync()
    start = time.perf_counter()
    core.step()
    sync()
    return time.perf_counter() - start


def mode_steps(llm: LLM, ns: argparse.Namespace) -> None:
    core = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.config.model_config.vocab_size
    prefix = tokens(rng, ns.prefix_len, vocab)
    forever = SamplingParams(temperature=0, ignore_eos=True, max_tokens=ns.max_model_len - ns.prefix_len - ns.suffix_len)
    count = 0

    def add() -> None:
        nonlocal count
        core.add_request(Request(f"s{count}", prefix + tokens(rng, ns.suffix_len, vocab), forever))
        count += 1

    for _ in range(ns.decoders):
        add()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    for _ in range(8):  # warm: compile the mixed shapes
        add()
        core.step()
        core.step()
    decode_t, mixed_t = [], []
    for _ in range(ns.repeat):
        decode_t.append(timed_step(core))
        add()
        mixed_t.append(timed_step(core))
    print(f"== steps: {ns.decoders}..{count} decoding rows at ~{ns.prefix_len + ns.suffix_len} context; "
          f"mixed = those + one {ns.suffix_len}-token prefill over a cached {ns.prefix_len}-token prefix")
    print(f"decode step {1e3 * np.mean(decode_t):.2f} ms (p50 {1e3 * np.median(decode_t):.2f}), "
          f"mixed step {1e3 * np.mean(mixed_t):.2f} ms (p50 {1e3 * np.median(mixed_t):.2f})")
    for label, make in (("mixed", add), ("decode", None)):
        per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            for _ in range(ns.profile_steps):
                if make:
                    make()
                timed_step(core)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA or not torch.cuda.is_available():
                k = per_kernel[ev.name[:100]]
                k[0] += 1
                k[1] += getattr(ev, "device_time", None) or ev.cuda_time
        total = max(sum(v[1] for v in per_kernel.values()) / ns.profile_steps, 1e-9)
        print(f"-- {label} step kernels: {total / 1e3:.3f} ms of GPU time a step, "
              f"{sum(v[0] for v in per_kernel.values()) / ns.profile_steps:.0f} kernels")
        for name, (calls, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:ns.top]:
            print(f"  {t / ns.profile_steps:9.1f} us {100 * t / ns.profile_steps / total:5.1f}%  "
                  f"{calls / ns.profile_steps:6.1f}/step  {name}")


def mode_load(llm: LLM, ns: argparse.Namespace) -> None:
    core = llm.engine
    rng = np.random.default_rng(0)
    vocab = llm.config.model_config.vocab_size
    prefixes = [tokens(rng, ns.prefix_len, vocab) for _ in range(ns.num_prefixes)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=ns.output_len)
    prompts = [prefixes[i % ns.num_prefixes] + tokens(rng, ns.suffix_len, vocab) for i in range(ns.num_requests)]
    # warm: every prefix once, then a few of each shape
    for i, p in enumerate(prefixes + prompts[:16]):
        core.add_request(Request(f"w{i}", p, params))
    while core.has_unfinished_requests():
        core.step()
    arrivals = np.cumsum(rng.exponential(1 / ns.rate, size=ns.num_requests))
    start = time.perf_counter()
    sent = 0
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps: dict[str, list[float]] = {"decode": [], "mixed": [], "prefill": []}
    prev, prev_kind = time.perf_counter(), None
    while sent < ns.num_requests or core.has_unfinished_requests():
        now = time.perf_counter() - start
        while sent < ns.num_requests and arrivals[sent] <= now:
            core.add_request(Request(f"r{sent}", prompts[sent], params, arrival_time=time.monotonic()))
            sent += 1
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[sent] - now))
            prev_kind = None
            continue
        outs = core.step()
        t = time.perf_counter()
        if prev_kind is not None:
            steps[prev_kind].append(t - prev)
        d, p = kinds(core)
        prev, prev_kind = t, ("decode" if p == 0 else "prefill" if d == 0 else "mixed") if core.in_flight else None
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, t)
                last[o.request_id] = t
    ids = [f"r{i}" for i in range(ns.num_requests)]
    ttft = np.array([first[i] - start - arrivals[k] for k, i in enumerate(ids)]) * 1e3
    tpot = np.array([(last[i] - first[i]) / (ns.output_len - 1) for i in ids]) * 1e3
    print(f"== load: {ns.num_requests} requests at {ns.rate}/s, {ns.num_prefixes} prefixes of {ns.prefix_len} + "
          f"{ns.suffix_len} own tokens, {ns.output_len} out; budget {llm.config.max_num_batched_tokens}, "
          f"seats {llm.config.max_num_seqs}")
    print(f"TTFT mean {ttft.mean():.1f} p50 {np.median(ttft):.1f} p99 {np.percentile(ttft, 99):.1f} ms; "
          f"TPOT mean {tpot.mean():.2f} p50 {np.median(tpot):.2f} p99 {np.percentile(tpot, 99):.2f} ms")
    for kind, ts in steps.items():
        if ts:
            print(f"  {kind:8s} steps {len(ts):5d}  mean {1e3 * np.mean(ts):6.2f} ms  p90 "
                  f"{1e3 * np.percentile(ts, 90):6.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("modes", nargs="+", choices=["steps", "load"])
    ap.add_argument("--decoders", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=1536)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--rate", type=float, default=32.0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--mixed-graph-max-tokens", type=int, default=None, help="0: mixed steps eager")
    ns = ap.parse_args()
    budget = {k: v for k, v in (("max_num_batched_tokens", ns.max_num_batched_tokens),
                                ("max_num_seqs", ns.max_num_seqs),
                                ("mixed_graph_max_tokens", ns.mixed_graph_max_tokens)) if v is not None}
    llm = LLM(ns.model, load_format="dummy", seed=0, max_model_len=ns.max_model_len, usage_context="serve", **budget)
    for mode in ns.modes:
        llm.engine.max_in_flight = 1 if mode == "load" else 0  # async scheduling: the load only
        (mode_steps if mode == "steps" else mode_load)(llm, ns)


if __name__ == "__main__":
    main()
