"""Where a decode step's GPU time goes: torch.profiler over a window of engine steps (after
the prefills), kernels grouped by name, in µs per step, with the window's wall time per
step. Kernels replayed from CUDA graphs are listed like launched ones.

    python3 benchmarks/scripts/profile_gpu_steps.py benchmarks/configs/qwen3-0.6b \
        --num-prompts 1 --input-len 128 --output-len 160 --skip 40 --steps 60 [--kv-cache-dtype fp8]
"""

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ember import LLM
from ember.bench.throughput import random_requests
from ember.sampling_params import SamplingParams


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
    ns = ap.parse_args()
    if ns.skip + 2 + ns.steps >= ns.output_len:
        ap.error("--skip + 2 + --steps must stay below --output-len (the window must end before the run)")
    longest = ns.input_len + ns.output_len
    llm = LLM(ns.model, load_format="dummy", seed=0, kv_cache_dtype=ns.kv_cache_dtype,
              max_model_len=max(2048, longest), max_num_seqs=max(ns.num_prompts, 1),
              max_num_batched_tokens=ns.max_num_batched_tokens)
    reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, 0.0, llm.config.model_config.vocab_size,
                           [], 0)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=ns.output_len)
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs[:1]], params)  # compile, warm up

    core = llm.engine
    step = core.step
    marks: list[float] = []
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=ns.skip, warmup=2, active=ns.steps, repeat=1))

    def profiled_step():
        out = step()
        prof.step()
        marks.append(time.perf_counter())
        return out

    core.step = profiled_step
    with prof:
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params)
    core.step = step
    first = ns.skip + 2
    wall = (marks[first + ns.steps - 1] - marks[first - 1]) / ns.steps
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("ProfilerStep"):
            t = getattr(ev, "device_time", None) or ev.cuda_time
            k = per_kernel[ev.name[:90]]
            k[0] += 1
            k[1] += t
    total = sum(v[1] for v in per_kernel.values()) / ns.steps
    print(f"== {ns.model} x{ns.num_prompts} in {ns.input_len} out {ns.output_len} kv {ns.kv_cache_dtype}: "
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


if __name__ == "__main__":
    main()
