"""Which Triton kernel variants a run builds (compiled, or loaded from Triton's disk cache)
and when: runs `ember bench ...` in this process with hooks on Triton's JIT and lists each
variant with its time, marking those first needed inside a timed `generate` (they stall the
run; a cold disk cache makes that seconds).

    python3 benchmarks/scripts/compile_watch.py bench throughput benchmarks/configs/qwen3-0.6b ...
"""

import sys
import time

import triton

from ember.engine.llm import LLM
from ember.server.cli import main

T0 = time.perf_counter()
started: dict = {}
events: list[tuple[float, float, str, str]] = []
windows: list[tuple[float, float]] = []


def on_start(*, key, fn, **_) -> bool:
    started[(fn.name, str(key))] = time.perf_counter()
    return False  # build it


def on_built(*, key, fn, compile, **_) -> None:
    t = time.perf_counter()
    consts = ", ".join(f"{k[-1] if isinstance(k, tuple) else k}={v}" for k, v in compile["constants"].items())
    events.append((started.pop((fn.name, str(key)), t), t, fn.name,
                   f"{consts}; warps {compile['num_warps']} stages {compile['num_stages']}"))


generate = LLM.generate


def timed_generate(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return generate(self, *args, **kwargs)
    finally:
        windows.append((start, time.perf_counter()))


if __name__ == "__main__":
    triton.knobs.runtime.jit_cache_hook = on_start
    triton.knobs.runtime.jit_post_compile_hook = on_built
    LLM.generate = timed_generate
    main(sys.argv[1:])
    print(f"== {len(events)} Triton kernel variants built; generate windows (s): "
          + ", ".join(f"{a - T0:.1f}-{b - T0:.1f}" for a, b in windows))
    for a, b, name, what in events:
        inside = any(s <= a <= e for s, e in windows)
        print(f"{'IN RUN ' if inside else '       '}{a - T0:7.2f} s +{b - a:6.3f} s  {name}  {what[:300]}")
