"""The scheduling defaults per device and use (defaults.py) and the start log of where each
tuning knob's value came from: a flag, the --config file, an LLM argument, or the default
for the device and use."""

from __future__ import annotations

import logging

import pytest
import torch

from ember.config import EngineConfig
from ember.defaults import LARGE_GPU_BYTES, scheduling_defaults
from ember.server.cli import engine_args, parse_args


def _settings_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings: ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_cpu_defaults_are_the_same_offline_and_serving():
    assert scheduling_defaults("cpu", "offline") == scheduling_defaults("cpu", "serve")
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


@pytest.mark.gpu
def test_a_large_gpu_batches_offline_and_keeps_serving_steps_short():
    assert torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES, "run on an H100/H200-class GPU"
    offline, serve = scheduling_defaults("cuda", "offline"), scheduling_defaults("cuda", "serve")
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (512, 16384)
    assert (serve.max_num_seqs, serve.max_num_batched_tokens) == (256, 2048)


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
    from ember import LLM

    llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=3072)
    kv_tokens = llm.engine.runner.num_blocks * llm.config.block_size
    assert 256 < llm.engine.scheduler.max_num_seqs == llm.config.max_num_seqs == kv_tokens // 3072 < 512
    assert llm.engine.runner.graphs.max_batch == llm.config.max_num_seqs
    del llm
    by_hand = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=3072, max_num_seqs=512)
    assert by_hand.engine.scheduler.max_num_seqs == 512
