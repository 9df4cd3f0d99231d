"""L2 prefetch (kernels/prefetch.py, layers/prefetch.py): which lines, the plan's syntax, a
no-op off CUDA; on the GPU (`-m gpu`) the PTX holds the prefetches, the data is untouched,
and a model's greedy tokens are the same with every site prefetched."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.prefetch import prefetch_l2, split_fraction
from ember.layers import prefetch as layer_prefetch
from ember.layers.prefetch import parse_plan


def test_split_fraction():
    assert split_fraction(1.0) == (8, 8)
    assert split_fraction(0.5) == (8, 4)
    assert split_fraction(0.25) == (8, 2)
    assert split_fraction(0.125) == (8, 1)
    assert split_fraction(0.05) == (20, 1)
    assert split_fraction(0.01) == (100, 1)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
            split_fraction(bad)


def test_plan_syntax():
    assert parse_plan("") == {}
    assert parse_plan("o=1, qkv=0.25") == {"o": 1.0, "qkv": 0.25}
    assert parse_plan("gate_up=0.05,down=0.1,") == {"gate_up": 0.05, "down": 0.1}
    for bad in ("x=1", "o", "o="):
        with pytest.raises(ValueError, match="SITE=FRACTION"):
            parse_plan(bad)


def test_off_cuda_is_a_no_op():
    w = torch.randn(64, 64)
    assert prefetch_l2(w, 1.0) is None
    with pytest.raises(ValueError, match="hint must be one of"):
        prefetch_l2(w, 1.0, hint="first")


@pytest.mark.gpu
@pytest.mark.parametrize("hint", ["normal", "last"])
def test_kernel_issues_prefetches(hint):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = w.clone()
    kernel = prefetch_l2(w, 0.5, hint)
    torch.cuda.synchronize()
    ptx = kernel.asm["ptx"]
    assert ptx.count("prefetch.global.L2" + ("::evict_last" if hint == "last" else " ")) >= 1
    assert torch.equal(w, before)
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_l2(w.t(), 1.0)


@pytest.mark.gpu
def test_model_tokens_unchanged_with_prefetch(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ember import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 7 * i))} for i in range(3)]
    outs = []
    for plan in ({}, {"qkv": 0.25, "o": 1.0, "gate_up": 0.05, "down": 0.1}):
        monkeypatch.setattr(layer_prefetch, "PLAN", plan)
        llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", max_model_len=256, max_num_seqs=4,
                  gpu_memory_utilization=0.3, seed=0)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]
