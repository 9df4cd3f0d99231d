"""ember/bench/dummy_gguf.py: a GGUF of random blocks at a model's shapes (the GPU benchmarks'
Q4_K_M file) is one ember reads as llama.cpp would: llama.cpp's Q4_K_M type per tensor, the
values spread as dummy weights are, a vocabulary its tokenizer loads."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ember.bench.dummy_gguf import _SCALES, random_blocks, tensor_type, write_dummy_gguf  # noqa: E402
from ember.layers.quant.ggml import dequantize  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "vocab_size": 600, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def test_q4_k_m_types_follow_llama_cpp_s_rule():
    """8 layers: attn_v and ffn_down in Q6_K in layers 0 and 7 (the first and last eighth) and 3, 6
    ((i - 1) % 3 == 2), the output in Q6_K, everything else Q4_K."""
    more = [i for i in range(8) if tensor_type(f"blk.{i}.ffn_down.weight", 8, "Q4_K_M") == "Q6_K"]
    assert more == [0, 3, 6, 7]
    assert [tensor_type(f"blk.{i}.attn_v.weight", 8, "Q4_K_M") for i in (0, 1)] == ["Q6_K", "Q4_K"]
    assert tensor_type("output.weight", 8, "Q4_K_M") == "Q6_K"
    assert {tensor_type(n, 8, "Q4_K_M") for n in ("token_embd.weight", "blk.0.attn_q.weight", "blk.7.ffn_up.weight")} \
        == {"Q4_K"}
    assert tensor_type("output.weight", 8, "Q8_0") == "Q8_0"


@pytest.mark.parametrize("qtype", list(_SCALES))
def test_random_blocks_spread_as_dummy_weights(qtype):
    rng = np.random.default_rng(0)
    values = dequantize(random_blocks(rng, qtype, 64, 512), gguf.GGMLQuantizationType[qtype], (64, 512))
    assert 0.01 < values.std().item() < 0.04 and abs(values.mean().item()) < 0.01, (values.std(), values.mean())


def test_the_file_loads_through_ember_s_gguf_path(tmp_path):
    from ember import LLM, SamplingParams
    from ember.layers.quant.gguf_blocks import GGUFBlocks
    from ember.layers.quant.split import Split

    path = write_dummy_gguf(CONFIG, tmp_path / "dummy.gguf")
    llm = LLM(str(path), max_model_len=128, device="cpu")
    assert llm.config.quantization == "gguf" and llm.config.model_config.vocab_size == 600
    model = llm.engine.runner.model
    qkv = [m.format for n, m in model.named_modules() if n.endswith("qkv_proj")]
    assert [type(f) for f in qkv] == [Split, GGUFBlocks, GGUFBlocks, Split, GGUFBlocks, GGUFBlocks, Split, Split]
    assert llm.tokenizer.encode("hi!") == [71, 72, 0] and llm.tokenizer.eos_token_ids == frozenset({599})
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and all(0 <= t < 600 for t in out[0].outputs[0].token_ids)
