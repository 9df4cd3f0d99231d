"""The engine's flags are EngineConfig's `flag` fields, and everything else is derived from
them: the command line (names, types, choices, defaults), the arguments it makes, the choice
checks and the tuning knobs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ember.config import TUNING_KNOBS, EngineConfig, flag_fields, flag_types
from ember.engine_args import add_engine_args, engine_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_flag_field_is_on_the_command_line_with_its_default_and_choices():
    actions = {a.dest: a for a in parser()._actions}
    for f in flag_fields():
        if f.name == "model":  # the positional argument
            assert actions["model"].option_strings == [] and actions["model_flag"].option_strings == ["--model", "--model-path"]
            continue
        action = actions[f.name]
        kind, choices, _ = flag_types()[f.name]
        assert action.help == f.metadata["help"]
        if f.name == "runner":  # --task may stand in for it, so its own default is None
            assert action.default is None and tuple(action.choices) == choices
            continue
        assert action.default == f.default, f.name
        assert (tuple(action.choices) if action.choices else None) == choices, f.name
    assert actions["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp", "--tp-size", "--tp"]
    assert actions["structured_outputs_jump_forward"].option_strings == ["--no-jump-forward"]


def test_a_field_made_a_flag_reaches_the_engine_without_another_edit():
    """attention_backend became a flag by its field alone."""
    ns = parser().parse_args(["m.gguf", "--attention-backend", "torch", "-tp", "2", "--no-jump-forward",
                              "--no-enable-prefix-caching", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5"])
    args = engine_args(ns)
    assert {k: args[k] for k in ("model", "attention_backend", "tensor_parallel_size",
                                 "structured_outputs_jump_forward", "enable_prefix_caching", "max_num_seqs",
                                 "gpu_memory_utilization", "runner")} == {
        "model": "m.gguf", "attention_backend": "torch", "tensor_parallel_size": 2,
        "structured_outputs_jump_forward": False, "enable_prefix_caching": False, "max_num_seqs": 8,
        "gpu_memory_utilization": 0.5, "runner": "auto"}
    assert set(args) == {f.name for f in flag_fields()} | {"setting_sources"}
    config = EngineConfig(**args)
    assert config.attention_backend == "torch" and config.max_num_seqs == 8


def test_a_choice_is_checked_by_its_literal_type():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch, triton; got 'cuda'"):
        EngineConfig(attention_backend="cuda")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray; got 'x'"):
        EngineConfig(distributed_executor_backend="x")
    assert EngineConfig(distributed_executor_backend=None).distributed_executor_backend is None
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer, got 0"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_tuning_knobs_are_the_fields_marked_knob():
    assert TUNING_KNOBS == ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "block_size",
                            "kv_cache_dtype", "scheduling_policy", "async_scheduling", "enable_prefix_caching")
    unset = {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in flag_fields()}
    assert unset == {"usage_context", "setting_sources", "model_config", "sampling_defaults", "attention_parity_len"}


def test_the_dtype_choices_are_the_dtypes_config_maps():
    from typing import get_args

    from ember.config import _DTYPES, _KV_CACHE_DTYPES, Dtype, KVCacheDtype

    assert set(get_args(Dtype)) == {"auto", *_DTYPES}
    assert set(get_args(KVCacheDtype)) == set(_KV_CACHE_DTYPES)
