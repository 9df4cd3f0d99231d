"""The scheduling knobs' defaults per device and use (vLLM's usage contexts), and the start
log that says where each tuning knob's value came from (the knobs: config.TUNING_KNOBS).

Offline batches (`LLM`, `ember bench throughput`) want throughput: many seats and a large
token budget, so prefills go in big steps. A server wants a step short enough that the
requests already decoding are not held up long by another's prefill: a smaller budget. The
CPU is compute-bound at any batch, so its budget stays at llama.cpp's ubatch.
The GPU values are from the sweep in benchmarks/BENCHMARKS.md ("defaults that fit").

The host tier under the prefix cache (--kv-offload-gib) is on by default on CUDA: at the
Llama-8B shape it cost no throughput (512 x 1000/1000 on an H100, -0.3 % with 16 GiB) and
halves a returning conversation's TTFT once the pool has evicted it; its pinned buffers are
made after start-up (runner/kv_copies.py), so they do not delay it. On the CPU the pool is in
host memory already, so a tier there is off unless asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

USAGES = ("offline", "serve")
# a vision model's serving budget on a GPU (vLLM's serving default): 2048 held two ~1,000-token
# images a step and starved the Qwen2.5-VL-7B race (BENCHMARKS.md, 2026-12-06)
SERVING_IMAGE_BUDGET = 8192
LARGE_GPU_BYTES = 70 << 30  # H100 80 GB, H200, B200: room for 512 seats' KV at 8B shapes
# a defaulted seat count is lowered to the sequences whose whole context the KV pool holds
# (seats_that_fit), but not below this: with long max_model_len most requests are far shorter
SEATS_FLOOR = 256
# the default host tier takes at most this share of the host's memory, split among the
# engines of this host (pinned memory is not paged out: the rest stays for everything else)
HOST_TIER_SHARE = 4
# set by `ember serve --data-parallel-size N` in each replica's environment: the engines of
# this launch that share the host's memory (server/data_parallel.py)
ENGINES_ON_HOST_VARIABLE = "EMBER_ENGINES_ON_HOST"
# a container's memory limit, which the default host tier's share is of where it is less than the host's
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclass(frozen=True)
class SchedulingDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    why: str  # the device class and use they were chosen for


def scheduling_defaults(device: str, usage: str, images: bool = False) -> SchedulingDefaults:
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
    if images:  # a step holds whole images (~1,000 tokens each at 1024x768): 2048 admits two a step
        return SchedulingDefaults(256, SERVING_IMAGE_BUDGET, f"serving a vision model on {gpu}")
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


@dataclass(frozen=True)
class HostTierDefault:
    gib: float  # 0: off
    why: str  # for the start log


def host_tier_default(device: str, pool_bytes: int, host_bytes: int, engines: int,
                      refused: str | None) -> HostTierDefault:
    """The host tier's size when kv_offload_gib is left unset: off on the CPU and where the tier
    is refused (`refused`: why), else on CUDA as large as the KV pool (a copy of every block it
    can evict), but no more than 1/HOST_TIER_SHARE of the host's memory shared by the `engines`
    (each allocates its own) of this host."""
    if device != "cuda":
        return HostTierDefault(0.0, "off on the CPU, whose KV pool is in host memory already")
    if refused is not None:
        return HostTierDefault(0.0, f"off: the tier {refused}")
    engines = max(1, engines)
    share = host_bytes // HOST_TIER_SHARE // engines
    if pool_bytes <= share:
        size, why = pool_bytes, f"the KV pool's size, {pool_bytes / 2**30:.2f} GiB"
    else:
        size, why = share, (f"1/{HOST_TIER_SHARE} of the host's {host_bytes / 2**30:.1f} GiB over {engines} "
                            f"engine{'s' if engines > 1 else ''}, less than the KV pool's {pool_bytes / 2**30:.2f} GiB")
    # down to a power of two: the sizes the default's cost was measured at (BENCHMARKS.md, 2026-12-06);
    # the tier's buffers (runner/kv_copies.py HostSlots) would pin any size as asked
    floor = 1 << (size.bit_length() - 1) if size else 0
    return HostTierDefault(floor / 2**30, f"on CUDA: {why}, down to a power of two")


def host_memory_bytes(limits: Sequence[str] = CGROUP_MEMORY_LIMITS) -> int:
    """The host's physical memory, or a container's memory limit where that is less (the first of
    `limits` that holds a number: cgroup v2's, else v1's; "max" where there is none)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in limits:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        return min(memory, int(limit)) if limit.isdigit() else memory
    return memory


def engines_on_host(tensor_parallel_size: int) -> int:
    """The engine processes of this launch that hold a host tier on this host: the data-parallel
    replicas (ENGINES_ON_HOST_VARIABLE, 1 unset) times each one's tensor-parallel ranks."""
    return int(os.environ.get(ENGINES_ON_HOST_VARIABLE) or 1) * tensor_parallel_size
