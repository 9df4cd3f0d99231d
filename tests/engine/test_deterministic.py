"""Deterministic mode (--deterministic, layers/batch_invariant.py) on the CPU: the dense path
(the default model dequantized, oneDNN matmuls, whose kernel follows the row count) becomes
batch-invariant too; and what the mode refuses on CUDA, by name. Its CUDA kernels are tested
in tests/kernels/test_matmul.py and, whole, in tests/models/test_cuda_deterministic.py."""

from __future__ import annotations

import argparse

import pytest
from invariance import assert_batch_invariant

from ember.config import _check_deterministic
from ember.models.config import ModelConfig
from ember.server.cli import add_engine_args, engine_args

pytestmark = pytest.mark.slow


def test_the_dense_path_is_batch_invariant_in_deterministic_mode(gguf_path, llm):
    tok = llm.get_tokenizer()
    texts = ["The river begins in the hills above the town, where a dozen small streams run together between "
             "stones and ferns. In spring the water is", "The river begins in the hills above the town, where "
             "a dozen small streams run together between stones and ferns. The mill", "Once upon a time"]
    reference = assert_batch_invariant(gguf_path, [tok.encode(t) for t in texts], max_tokens=12, block_size=16,
                                       quantization="none", dtype="float32", deterministic=True)
    head = reference.engine.runner.model.lm_head
    assert reference.config.deterministic and head.batch_invariant
    assert all(attn.backend.batch_invariant for attn in reference.engine.runner.model.attention_layers())


def test_the_flag_reaches_the_engine():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args(parser.parse_args([]))["deterministic"] is False
    assert engine_args(parser.parse_args(["--deterministic"]))["deterministic"] is True


def test_what_deterministic_mode_refuses_on_cuda():
    shape = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
             "max_position_embeddings": 64}
    dense = ModelConfig.from_hf_config(shape)
    _check_deterministic(dense, "none", 1)
    moe = ModelConfig.from_hf_config(shape | {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                                              "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="mixtral: deterministic mode does not cover the mixture-of-experts"):
        _check_deterministic(moe, "none", 1)
    with pytest.raises(ValueError, match="use quantization='none' with deterministic=True"):
        _check_deterministic(dense, "fp8", 1)
    with pytest.raises(ValueError, match="deterministic mode runs on one GPU"):
        _check_deterministic(dense, "none", 2)
