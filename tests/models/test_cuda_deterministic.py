"""Deterministic mode on CUDA (`-m gpu`; --deterministic, layers/batch_invariant.py) at the
Qwen3-0.6B shape with dummy bfloat16 weights: CUDA graphs give the eager forward's bits, and
a request's greedy tokens and logprobs are the same alone, in a batch, with chunked prefill
at small budgets, after a prefix-cache hit and after preemption (tests/invariance.py).
The default mode is measured on the same cases and printed (not asserted: cuBLAS, the GEMV
and flash-decoding follow the batch there, which is why the mode exists)."""

from __future__ import annotations

import pytest
import torch
from invariance import assert_batch_invariant, outputs, prompts_with_a_shared_prefix

pytestmark = pytest.mark.gpu

CONFIG = "benchmarks/configs/qwen3-0.6b"
VOCAB = 151936
# small engines: a few seats (few graphs to capture), a fixed pool (several live at once)
ARGS = dict(load_format="dummy", dtype="bfloat16", seed=0, max_num_seqs=8, num_kv_blocks=96)


@pytest.fixture(autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_graphs_give_the_eager_bits():
    from ember import LLM

    prompts = prompts_with_a_shared_prefix(VOCAB, count=5)  # batch 5: padded to a graph of 8
    got = {}
    for eager in (True, False):
        llm = LLM(CONFIG, enforce_eager=eager, deterministic=True, block_size=16, max_model_len=256, **ARGS)
        assert (llm.engine.runner.graphs is None) == eager
        got[eager] = outputs(llm, prompts, 24)
        del llm
    assert got[True] == got[False]


def test_a_request_gets_the_same_bits_however_it_is_batched():
    llm = assert_batch_invariant(CONFIG, prompts_with_a_shared_prefix(VOCAB), block_size=16, deterministic=True,
                                 **ARGS)
    assert llm.engine.runner.graphs is not None  # decode steps replayed graphs, prefills ran eager


def test_the_default_mode_for_the_record():
    try:
        assert_batch_invariant(CONFIG, prompts_with_a_shared_prefix(VOCAB), block_size=16, **ARGS)
        print("invariance: the default bf16 mode gave every case the same bits too")
    except AssertionError as e:
        print(f"invariance: the default bf16 mode is not batch-invariant: {e}")
