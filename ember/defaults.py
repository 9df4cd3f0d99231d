"""The scheduling knobs' defaults per device and use (vLLM's usage contexts), and the start
log that says where each tuning knob's value came from (the knobs: config.TUNING_KNOBS).

Offline batches (`LLM`, `ember bench throughput`) want throughput: many seats and a large
token budget, so prefills go in big steps. A server wants a step short enough that the
requests already decoding are not held up long by another's prefill: a smaller budget. The
CPU is compute-bound at any batch, so its budget stays at llama.cpp's ubatch.
The GPU values are from the sweep in benchmarks/BENCHMARKS.md ("defaults that fit").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

USAGES = ("offline", "serve")
LARGE_GPU_BYTES = 70 << 30  # H100 80 GB, H200, B200: room for 512 seats' KV at 8B shapes
# a defaulted seat count is lowered to the sequences whose whole context the KV pool holds
# (seats_that_fit), but not below this: with long max_model_len most requests are far shorter
SEATS_FLOOR = 256


@dataclass(frozen=True)
class SchedulingDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str  # the device class and use they were chosen for


def scheduling_defaults(device: str, usage: str) -> SchedulingDefaults:
    if usage not in USAGES:
        raise ValueError(f"usage_context must be one of {', '.join(USAGES)}; got {usage!r}")
    if device != "cuda":
        # 512 tokens: SmolLM2-135M fp32 on 2 AVX2 cores takes ~2 s a 512-token step, 8-28 s for 2048
        return SchedulingDefaults(256, 512, "the CPU")
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    large = memory >= LARGE_GPU_BYTES
    gpu = f"a GPU of {memory / 2**30:.0f} GiB"
    if usage == "offline":
        return SchedulingDefaults(512, 16384, f"offline on {gpu}") if large else \
            SchedulingDefaults(256, 8192, f"offline on {gpu}")
    return SchedulingDefaults(256, 2048, f"serving on {gpu}")


def seats_that_fit(max_num_seqs: int, kv_tokens: int, max_model_len: int) -> int:
    """The seats to run with when max_num_seqs is the default: no more than the KV pool holds
    at max_model_len each, as more only buy preemptions once the sequences grow (Llama-8B
    shape 512 x 1000/1000 on an H200: 426 seats run without any, 512 preempt 80 times and
    lose 9 %), and not below SEATS_FLOOR (or the default, if lower)."""
    return min(max_num_seqs, max(min(SEATS_FLOOR, max_num_seqs), kv_tokens // max_model_len))


def log_settings(knobs: Sequence[str], values: Mapping[str, object], sources: Mapping[str, str],
                 defaults: SchedulingDefaults) -> None:
    """One line: each tuning knob's value and where it came from (a flag, the config file, an
    argument, or the default, with the device and use it is the default for)."""
    parts = []
    for name in knobs:
        source = sources.get(name, "default")
        if source == "default" and name in ("max_num_seqs", "max_num_batched_tokens"):
            source = f"default for {defaults.why}"
        parts.append(f"{name}={values[name]} ({source})")
    logger.info("settings: %s", ", ".join(parts))
