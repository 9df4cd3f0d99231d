"""Time one decode step at batch 16 (64-token prompts, temperature 1) and profile it.

    .venv/bin/python benchmarks/scripts/decode_step.py [float32|bfloat16]
"""

import random
import sys
import time

from torch.profiler import ProfilerActivity, profile

from ember import LLM, SamplingParams
from ember.request import Request


def main(dtype: str) -> None:
    core = LLM(dtype=dtype).engine
    rng = random.Random(0)
    for i in range(16):
        core.add_request(Request(f"r{i}", [rng.randrange(20, 49000) for _ in range(64)],
                                 SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True)))
    for _ in range(9):  # the prefill, then warm-up decodes
        core.step()
    steps = 20
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    step = (time.perf_counter() - start) / steps
    print(f"{dtype}: decode step at batch 16: {step * 1000:.1f} ms -> {16 / step:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            core.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
