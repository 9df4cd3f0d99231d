"""The scheduling defaults per device and use (defaults.py) and the start log of where each
tuning knob's value came from: a flag, the --config file, an LLM argument, or the default
for the device and use; the host tier's default size (on CUDA: the KV pool, at most a quarter
of the host's memory over its engines; off on the CPU), and its refusals for an explicit size."""

from __future__ import annotations

import logging

import pytest
import torch

from ember.config import EngineConfig
from ember.defaults import LARGE_GPU_BYTES, scheduling_defaults
from ember.sampling_params import SamplingParams
from ember.server.cli import engine_args, parse_args


def _settings_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings: ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_cpu_defaults_are_the_same_offline_and_serving():
    assert scheduling_defaults("cpu", "offline") == scheduling_defaults("cpu", "serve") \
        == scheduling_defaults("cpu", "serve", images=True)
    assert (scheduling_defaults("cpu", "serve").max_num_seqs, scheduling_defaults("cpu", "serve")
            .max_num_batched_tokens) == (256, 512)
    with pytest.raises(ValueError, match="usage_context must be one of offline, serve; got 'batch'"):
        EngineConfig(usage_context="batch")


def test_the_log_names_flags_the_config_file_arguments_and_defaults(gguf_path, tmp_path, caplog):
    config = tmp_path / "tuned.yaml"
    config.write_text("max-num-batched-tokens: 256\nblock_size: 32\nmax_num_seqs: 64\n")
    ns = parse_args(["serve", str(gguf_path), "--config", str(config), "--max-num-seqs", "8"])
    with caplog.at_level(logging.INFO, logger="ember.defaults"):
        resolved = EngineConfig(**engine_args(ns), usage_context="serve").resolve()
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens, resolved.block_size) == (8, 256, 32)
    assert _settings_line(caplog) == (
        "settings: max_num_seqs=8 (flag), max_num_batched_tokens=256 (config file), gpu_memory_utilization=0.9 "
        "(default), block_size=32 (config file), kv_cache_dtype=float16 (default), scheduling_policy=fcfs "
        "(default), async_scheduling=False (default), enable_prefix_caching=True (default)")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember.defaults"):
        resolved = EngineConfig(model=str(gguf_path), max_num_batched_tokens=128).resolve()
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (256, 128)
    assert _settings_line(caplog).startswith(
        "settings: max_num_seqs=256 (default for the CPU), max_num_batched_tokens=128 (argument), ")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember.defaults"):
        assert resolved.resolve() is resolved  # resolved once: nothing read or logged again
    assert caplog.records == []


@pytest.mark.gpu
def test_a_large_gpu_batches_offline_and_keeps_serving_steps_short():
    assert torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES, "run on an H100/H200-class GPU"
    offline, serve = scheduling_defaults("cuda", "offline"), scheduling_defaults("cuda", "serve")
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (512, 16384)
    assert (serve.max_num_seqs, serve.max_num_batched_tokens) == (256, 2048)
    images = scheduling_defaults("cuda", "serve", images=True)  # a step holds whole images
    assert (images.max_num_seqs, images.max_num_batched_tokens) == (256, 8192)
    assert images.why.startswith("serving a vision model on a GPU of ")


def test_a_defaulted_seat_count_is_what_the_kv_pool_holds_at_max_model_len(gguf_path):
    from ember import LLM
    from ember.defaults import seats_that_fit

    assert seats_that_fit(512, 6827 * 128, 2048) == 426  # Llama-8B shape on an H200: no preemption
    assert seats_that_fit(512, 8192 * 128, 2048) == 512
    assert seats_that_fit(512, 6827 * 128, 131072) == 256  # long contexts: most requests are far shorter
    assert seats_that_fit(64, 1000, 1000) == 64  # a default below the floor stays
    # the CPU's default (256) is the floor: 40 blocks of 16 at max_model_len 128 hold 5, and 256 stay
    fitted = LLM(str(gguf_path), num_kv_blocks=40, max_model_len=128, max_num_batched_tokens=128)
    assert (fitted.config.max_num_seqs, fitted.engine.scheduler.max_num_seqs) == (256, 256)


@pytest.mark.gpu
def test_a_large_gpu_offline_runs_the_seats_its_kv_pool_holds():
    import torch

    from ember import LLM

    # a context length at which the pool holds 256 .. 512 of them: ~1.0M tokens on an H200, ~0.56M on an H100
    length = 3072 if torch.cuda.get_device_properties(0).total_memory > 100 << 30 else 2048
    llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=length)
    kv_tokens = llm.engine.runner.num_blocks * llm.config.block_size
    assert 256 < llm.engine.scheduler.max_num_seqs == llm.config.max_num_seqs == kv_tokens // length < 512
    assert llm.engine.runner.graphs.max_batch == llm.config.max_num_seqs
    del llm
    by_hand = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=length, max_num_seqs=512)
    assert by_hand.engine.scheduler.max_num_seqs == 512


def test_the_host_tier_default_is_the_pool_at_most_a_quarter_of_the_host_over_its_engines():
    from ember.defaults import HostTierDefault, host_tier_default

    gib = 1 << 30
    assert host_tier_default("cpu", 20 * gib, 2048 * gib, 1, None) == HostTierDefault(
        0.0, "off on the CPU, whose KV pool is in host memory already")
    assert host_tier_default("cuda", 20 * gib, 2048 * gib, 1, "needs X") == HostTierDefault(0.0, "off: the tier needs X")
    assert host_tier_default("cuda", 20 * gib, 2048 * gib, 8, None) == HostTierDefault(
        16.0, "on CUDA: the KV pool's size, 20.00 GiB, down to a power of two")  # 2048 / 4 / 8 = 64 GiB a GPU
    assert host_tier_default("cuda", 60 * gib, 128 * gib, 1, None) == HostTierDefault(
        32.0, "on CUDA: 1/4 of the host's 128.0 GiB over 1 engine, less than the KV pool's 60.00 GiB, down to a "
        "power of two")
    assert host_tier_default("cuda", 60 * gib, 128 * gib, 8, None).gib == 4.0
    assert host_tier_default("cuda", 60 * gib, 100 * gib, 3, None).gib == 8.0  # (100 GiB // 4) // 3 = 8.33 GiB
    assert host_tier_default("cuda", 60 * gib, 100 * gib, 0, None).gib == 16.0  # at least one engine: 25 GiB
    # a pool of 9 MiB: 8 asked for (torch would pin 16 MiB for 9)
    assert host_tier_default("cuda", 9 << 20, 128 * gib, 1, None).gib == (8 << 20) / gib


def test_the_host_memory_is_a_containers_limit_where_that_is_less(tmp_path):
    import os

    from ember.defaults import host_memory_bytes

    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert host_memory_bytes([str(v2), str(v1)]) == physical  # neither file: not in a container
    v1.write_text("9223372036854771712\n")  # cgroup v1 without a limit
    assert host_memory_bytes([str(v2), str(v1)]) == physical
    v1.write_text(f"{physical // 3}\n")
    assert host_memory_bytes([str(v2), str(v1)]) == physical // 3
    v2.write_text("max\n")  # cgroup v2 without a limit: the first file found decides
    assert host_memory_bytes([str(v2), str(v1)]) == physical
    v2.write_text("1073741824\n")
    assert host_memory_bytes([str(v2), str(v1)]) == 1 << 30


def test_the_engines_on_a_host_are_the_replicas_times_their_ranks(monkeypatch):
    from ember.defaults import engines_on_host

    monkeypatch.delenv("EMBER_ENGINES_ON_HOST", raising=False)
    assert (engines_on_host(1), engines_on_host(2)) == (1, 2)
    monkeypatch.setenv("EMBER_ENGINES_ON_HOST", "4")  # ember serve --data-parallel-size 4 sets it
    assert (engines_on_host(1), engines_on_host(2)) == (4, 8)


def test_the_host_tier_is_off_by_default_on_the_cpu_and_never_refused_by_default(gguf_path):
    """Unset, kv_offload_gib resolves to the runner's default (0 on the CPU); the refusals stay for
    an explicit size only, and an explicit 0 is off everywhere."""
    import dataclasses

    from ember import LLM
    from ember.config import _check_kv_offload

    assert EngineConfig().kv_offload_gib is None
    unset = LLM(str(gguf_path), num_kv_blocks=16, max_model_len=128)
    assert unset.config.kv_offload_gib is None
    assert (unset.engine.runner.num_host_blocks, unset.engine.scheduler.host) == (0, None)
    block = unset.engine.runner.kv_bytes_per_block()
    del unset
    # prefix caching off: unset is no error (the tier stays off); a size is refused, with the fix
    assert EngineConfig(model=str(gguf_path), enable_prefix_caching=False).resolve().kv_offload_gib is None
    assert EngineConfig(model=str(gguf_path), enable_prefix_caching=False, kv_offload_gib=0).resolve() \
        .kv_offload_gib == 0
    with pytest.raises(ValueError, match=r"kv_offload_gib keeps the blocks the prefix cache evicts: it needs the "
                                         r"prefix cache \(enable_prefix_caching, a generating model\): leave it 0"):
        EngineConfig(model=str(gguf_path), enable_prefix_caching=False, kv_offload_gib=1).resolve()
    with pytest.raises(ValueError, match="kv_offload_gib must be a number of GiB >= 0; got -1"):
        EngineConfig(model=str(gguf_path), kv_offload_gib=-1).resolve()
    mc = EngineConfig(model=str(gguf_path)).resolve().model_config
    windows = dataclasses.replace(mc, layer_windows=(None,) * (mc.num_layers - 1) + (64,))
    with pytest.raises(ValueError, match=r"kv_offload_gib is not supported for llama's sliding-window layers yet "
                                         r"\(their cache gives back blocks a window passed\): leave it 0 \(or unset\)"):
        _check_kv_offload(1.0, True, windows)
    _check_kv_offload(0.0, True, windows)  # off: nothing to refuse
    # an explicit size is kept: its blocks, made by the thread the runner started
    sized = LLM(str(gguf_path), num_kv_blocks=16, max_model_len=128, kv_offload_gib=8 * block / 2**30)
    assert (sized.config.kv_offload_gib, sized.engine.runner.num_host_blocks) == (8 * block / 2**30, 8)
    assert sized.engine.scheduler.host.num_slots == 8 and sized.engine.runner.kv_copies.tier[0].shape[0] == 8


@pytest.mark.gpu
def test_on_cuda_the_host_tier_is_on_by_default_and_its_pinned_buffers_come_after_start_up():
    from ember import LLM
    from ember.defaults import engines_on_host, host_memory_bytes, host_tier_default

    llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=1024, num_kv_blocks=64)
    runner = llm.engine.runner
    block = runner.kv_bytes_per_block()
    want = host_tier_default("cuda", 64 * block, host_memory_bytes(), engines_on_host(1), None)
    slots = int(want.gib * 2**30) // block  # a small pool: the tier holds it, down to a power of two of bytes
    assert 32 <= slots <= 64 and (1 << (64 * block).bit_length() - 1) == want.gib * 2**30
    assert runner.num_host_blocks == llm.engine.scheduler.host.num_slots == slots
    assert llm.config.kv_offload_gib is None and runner.kv_copies._tier_made is not None  # started, not waited for
    tier = runner.kv_copies.tier[0]
    assert tier.is_pinned() and tier.shape[0] == slots
    out = llm.generate([{"prompt_token_ids": list(range(100, 400))}], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
