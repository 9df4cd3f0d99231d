"""Where a decode step's GPU time goes: torch.profiler over a window of engine steps (after
the prefills), kernels grouped by name, in µs per step, with the window's wall time per
step. Kernels replayed from CUDA graphs are listed like launched ones. With --per-step (on with
--images) the steps before the window and each step in it get lines of their own: the step's
wall time (its engine step call) and tokens, and in the window its kernel time, so a
first-shape cost (a Triton compile, a tower's first shape) shows as a step far slower than a
later one of the same size.

    python3 benchmarks/scripts/profile_gpu_steps.py benchmarks/configs/qwen3-0.6b \
        --num-prompts 1 --input-len 128 --output-len 160 --skip 40 --steps 60 [--kv-cache-dtype fp8]

--images: each prompt a chat message of one random --image-size image (ember bench serve's
--dataset images, a JPEG data: URL) and --input-len tokens of text, through LLM.chat; on a
Qwen2.5-VL directory (issue #39's race: vision tower kernels against the LM's prefill ones):

    python3 benchmarks/scripts/served_model.py --vl .serve-vl     # here; carried to the device
    python3 benchmarks/scripts/profile_gpu_steps.py .serve-vl --images --num-prompts 256 \
        --input-len 128 --output-len 128 --skip 4 --steps 16 --max-num-batched-tokens 8192 [--no-warmup]

--gaps: where the device waits for the host. The engine's phases (schedule, launch, prepare, images,
pixel join, encode, forward, sample, collect, wait, update, propose, ...) are marked as ranges, and
each stretch of the window in which no kernel or copy runs on the GPU is charged to the host phases
open at its middle (outer > inner): the GPU's idle ms a step and what the host was doing meanwhile.
--speculative-config JSON: the engine's (an EAGLE-3 head of random weights for a dummy target:
`python -m ember.bench.dummy_eagle3 TARGET/config.json HEAD`), to see a drafting step's host cost:

    python3 benchmarks/scripts/profile_gpu_steps.py SMOL_DIR --num-prompts 32 --gaps --temperature 0 \
        --speculative-config '{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 4}'

On a machine without CUDA the "kernels" are the CPU's ops, each its self time (the tests' path).
"""

import argparse
import bisect
import functools
import inspect
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import ember.runner.multimodal as multimodal
from ember import LLM
from ember.bench.image_requests import image_requests
from ember.bench.throughput import random_requests
from ember.sampling_params import SamplingParams


def image_prompts(llm: LLM, num_prompts: int, input_len: int, output_len: int, size: str,
                  seed: int = 0) -> list[list[dict]]:
    """`num_prompts` conversations of one user message: a random `size` ("WxH") JPEG as an
    image_url data: URL, then `input_len` tokens of text (ember bench serve's --dataset images)."""
    width, height = (int(v) for v in size.lower().split("x"))
    reqs = image_requests(num_prompts, input_len, output_len, width, height, llm.tokenizer, seed)
    return [r.messages for r in reqs]


def _timed(owner: object, attr: str, name: str) -> None:
    """owner.attr (a function, or a callable object such as the sampler, whose other attributes
    stay readable) run inside record_function("host:" + name)."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    def timed(*args, **kwargs):
        with record_function("host:" + name):
            return fn(*args, **kwargs)

    if inspect.isfunction(fn) or inspect.ismethod(fn):
        setattr(owner, attr, functools.wraps(fn)(timed))
    else:
        setattr(owner, attr, type("Timed", (), {"__call__": lambda self, *a, **k: timed(*a, **k),
                                                "__getattr__": lambda self, n: getattr(fn, n)})())


def mark_phases(core) -> None:
    """The engine's phases as ranges in the trace (`--gaps`)."""
    runner = core.runner
    for owner, attr, name in [(core, "_collect", "collect"), (core, "_apply", "update"), (core, "_propose", "propose"),
                              (core.scheduler, "schedule", "schedule"), (runner, "launch", "launch"),
                              (runner, "_prepare", "prepare"), (runner, "collect", "wait"),
                              (runner, "propose_for", "drafter"), (runner, "sampler", "sample"),
                              (getattr(runner, "images", None), "inputs", "images"),
                              (getattr(runner, "images", None), "_encode", "encode"),
                              (multimodal, "join_to_device", "pixel join"),
                              (getattr(runner, "graphs", None), "replay_step", "graph replay"),
                              (getattr(runner, "drafter", None), "follow", "drafter follow"),
                              (getattr(runner, "drafter", None), "propose", "drafter propose"),
                              (runner.model, "forward", "forward")]:
        if owner is not None:
            _timed(owner, attr, name)


def _marks(ev) -> bool:
    """A range the profiler or `--gaps` marks (a step, a host phase): on the GPU's timeline too (a
    user annotation over the kernels launched inside it), where it is neither a kernel nor busy."""
    return ev.name.startswith(("ProfilerStep", "host:"))


def _steps(events) -> list:
    """The window's steps (ProfilerStep#k), as the host ran them."""
    return [ev for ev in events if ev.name.startswith("ProfilerStep") and ev.device_type == torch.autograd.DeviceType.CPU]


def idle_by_phase(events, steps: int) -> None:
    """Print the GPU's idle time in the window a step and the host phases open meanwhile (`--gaps`)."""
    window = [(ev.time_range.start, ev.time_range.end) for ev in _steps(events)]
    lo, hi = min(s for s, _ in window), max(e for _, e in window)
    busy = sorted((ev.time_range.start, ev.time_range.end) for ev in events
                  if ev.device_type == torch.autograd.DeviceType.CUDA and not _marks(ev) and lo <= ev.time_range.start < hi)
    phases = sorted((ev.time_range.start, ev.time_range.end, ev.name[5:]) for ev in events
                    if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("host:"))
    gaps, last = [], lo
    for start, end in busy:
        if start > last:
            gaps.append((last, start))
        last = max(last, end)
    if hi > last:
        gaps.append((last, hi))
    charged: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for start, end in gaps:
        mid = (start + end) / 2
        open_ = [name for s, e, name in phases[:bisect.bisect_right(phases, (mid, float("inf"), ""))] if e > mid]
        inside = any(s <= mid < e for s, e in window)
        key = " > ".join(open_) if open_ else ("(in a step, no phase)" if inside else "(between steps)")
        charged[key][0] += 1
        charged[key][1] += end - start
    idle = sum(t for _, t in charged.values())
    print(f"  GPU idle {idle / steps / 1e3:.3f} ms a step of {(hi - lo) / steps / 1e3:.3f} "
          f"({len(gaps) / steps:.0f} gaps a step); the host meanwhile:")
    for key, (count, t) in sorted(charged.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"  {t / steps / 1e3:9.3f} ms {count / steps:7.1f} gaps/step  {key}")
    spent: dict[str, float] = defaultdict(float)
    for start, end, name in phases:
        if lo <= start < hi:
            spent[name] += end - start
    print("  each phase's host time a step (nested phases inside their outer ones' too): "
          + ", ".join(f"{name} {t / steps / 1e3:.3f}" for name, t in sorted(spent.items(), key=lambda kv: -kv[1])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=160)
    ap.add_argument("--skip", type=int, default=40, help="engine steps before the window (prefills, warm-up)")
    ap.add_argument("--steps", type=int, default=60, help="engine steps profiled")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--images", action="store_true", help="chat prompts of one random image and --input-len tokens")
    ap.add_argument("--image-size", default="1024x768", help="with --images: WxH")
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up request first (its first-shape costs "
                    "then fall in the steps before the window)")
    ap.add_argument("--per-step", action="store_true", help="a line for each step (on with --images)")
    ap.add_argument("--gaps", action="store_true", help="the GPU's idle time and the host phases open meanwhile")
    ap.add_argument("--speculative-config", type=json.loads, default=None, help="the engine's, as JSON")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy (as the speculative races run)")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engine's (default --num-prompts; the decode graphs' largest batch: a step verifying "
                         "drafts needs num_prompts x (K + 1) rows in them)")
    ns = ap.parse_args()
    if ns.skip + 2 + ns.steps >= ns.output_len:
        ap.error("--skip + 2 + --steps must stay below --output-len (the window must end before the run)")
    longest = ns.input_len + ns.output_len
    if ns.images:  # the image's merged 28 x 28 patches and the chat template's tokens
        w, h = (int(v) for v in ns.image_size.lower().split("x"))
        longest += -(-w // 28) * -(-h // 28) + 64
    llm = LLM(ns.model, load_format="dummy", seed=0, kv_cache_dtype=ns.kv_cache_dtype,
              max_model_len=max(2048, longest), max_num_seqs=ns.max_num_seqs or max(ns.num_prompts, 1),
              max_num_batched_tokens=ns.max_num_batched_tokens, speculative_config=ns.speculative_config)
    params = SamplingParams(temperature=ns.temperature, ignore_eos=True, max_tokens=ns.output_len)
    if ns.images:
        convs = image_prompts(llm, ns.num_prompts, ns.input_len, ns.output_len, ns.image_size)
        if not ns.no_warmup:  # compile, warm up: an image of its own (no cache hit)
            llm.chat(image_prompts(llm, 1, ns.input_len, ns.output_len, ns.image_size, seed=1), params)
    else:
        reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, 0.0,
                               llm.config.model_config.vocab_size, [], 0)
        if not ns.no_warmup:
            llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs[:1]], params)  # compile, warm up

    core = llm.engine
    step, plan = core.step, core.scheduler.schedule
    marks: list[float] = []
    walls: list[float] = []  # each step call's own
    tokens: list[int] = []  # each step's scheduled tokens
    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                   schedule=schedule(wait=ns.skip, warmup=2, active=ns.steps, repeat=1))

    def counted_plan():
        out = plan()
        tokens[-1] += out.num_tokens
        return out

    def profiled_step():
        tokens.append(0)
        start = time.perf_counter()
        out = step()
        walls.append(time.perf_counter() - start)
        prof.step()
        marks.append(time.perf_counter())
        return out

    core.step, core.scheduler.schedule = profiled_step, counted_plan
    if ns.gaps:
        mark_phases(core)
    with prof:
        if ns.images:
            llm.chat(convs, params)
        else:
            llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params)
    core.step, core.scheduler.schedule = step, plan
    first = ns.skip + 2
    wall = (marks[first + ns.steps - 1] - marks[first - 1]) / ns.steps
    # the window's steps' ranges (ProfilerStep#k, in order); a kernel counts in the step its start falls in
    bounds = sorted(ev.time_range.start for ev in _steps(prof.events()))
    step_time = [0.0] * ns.steps
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if _marks(ev):
            continue
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(ev, "device_time", None) or ev.cuda_time
        elif not cuda and ev.device_type == torch.autograd.DeviceType.CPU:
            t = ev.self_cpu_time_total  # an op's own time, its children's apart
        else:
            continue
        k = per_kernel[ev.name[:90]]
        k[0] += 1
        k[1] += t
        i = bisect.bisect_right(bounds, ev.time_range.start) - 1
        step_time[min(max(i, 0), ns.steps - 1)] += t
    total = sum(v[1] for v in per_kernel.values()) / ns.steps
    what = f"images {ns.image_size} + " if ns.images else ""
    if ns.per_step or ns.images:
        print("  steps before the window: wall ms (tokens): "
              + " ".join(f"{w * 1e3:.1f} ({n})" for w, n in zip(walls[:first], tokens[:first])))
    for i in range(ns.steps if ns.per_step or ns.images else 0):
        print(f"  step {first + i:4d}: wall {walls[first + i] * 1e3:9.3f} ms  kernels {step_time[i] / 1e3:9.3f} ms  "
              f"tokens {tokens[first + i]}")
    print(f"== {ns.model} x{ns.num_prompts} in {what}{ns.input_len} out {ns.output_len} kv {ns.kv_cache_dtype}: "
          f"wall {wall * 1e3:.3f} ms/step, GPU kernels {total / 1e3:.3f} ms/step "
          f"({sum(v[0] for v in per_kernel.values()) / ns.steps:.0f} per step)")
    for name, (calls, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:ns.top]:
        print(f"  {t / ns.steps:9.1f} us {100 * t / ns.steps / total:5.1f}%  {calls / ns.steps:6.1f}/step  {name}")
    # the host's side: where the CPU spends a step (a CUDA runtime call that blocks, e.g. a
    # synchronizing copy, shows as a long cuda* entry)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            per_op[ev.key[:90]] = [ev.count, ev.self_cpu_time_total]
    print(f"  host: self CPU time a step, top {ns.top}")
    for name, (calls, t) in sorted(per_op.items(), key=lambda kv: -kv[1][1])[:ns.top]:
        print(f"  {t / ns.steps:9.1f} us  {calls / ns.steps:6.1f}/step  {name}")
    if ns.gaps and cuda:
        idle_by_phase(prof.events(), ns.steps)


if __name__ == "__main__":
    main()
