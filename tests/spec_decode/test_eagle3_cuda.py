"""Speculative decoding on CUDA (-m gpu): a tiny random Llama target, float32. A random EAGLE-3 head
in vLLM's layout, and a draft model (the target's first layers): their draft steps replayed as
CUDA graphs draft exactly what eager ones draft, and the tokens are the same either way. Prompt
lookup: the steps verifying drafts run in the decode graphs (a token a row), with the tokens of an
eager run without speculation."""

from __future__ import annotations

import pytest
import torch

from ember import LLM
from ember.bench.dummy_eagle3 import head_config, random_head, save_head
from ember.request import Request
from ember.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = [[5, 9, 9, 9, 2, 9, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7], [3, 4] * 9]


def drafted(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    core = llm.engine
    reqs = [Request(f"c{i}", p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    for r in reqs:
        core.add_request(r)
    proposals = []
    while core.has_unfinished_requests():
        core.step()
        proposals += [list(r.draft_token_ids) for r in reqs if r.draft_token_ids]
    core.check_idle()
    return [list(r.output_token_ids) for r in reqs], proposals


def _target(path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096)).save_pretrained(path)


def test_verifying_steps_run_in_the_decode_graphs(tmp_path, monkeypatch):
    _target(tmp_path / "target")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    args = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, seed=0)
    llm = LLM(str(tmp_path / "target"), speculative_config=spec, **args)
    graphs, rows = llm.engine.runner.graphs, []
    replay = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *a, **k: rows.append(len(ids)) or replay(ids, *a, **k))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path / "target"), enforce_eager=True, **args).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)]
    assert got == want
    assert max(rows) > len(PROMPTS)  # more rows than requests: steps with drafts replayed the graphs


def test_graphed_draft_steps_draft_what_eager_ones_do(tmp_path):
    _target(tmp_path / "target")
    config = head_config(128, 256, 128, [1, 4, 6], heads=4, kv_heads=2, intermediate=256)
    save_head(tmp_path / "head", config, random_head(config, seed=1, embed=True))
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    args = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, seed=0, speculative_config=spec)
    graphed = LLM(str(tmp_path / "target"), **args)
    assert graphed.engine.runner.drafter.graphs is not None
    eager = LLM(str(tmp_path / "target"), enforce_eager=True, **args)
    tokens, proposals = drafted(graphed)
    assert (tokens, proposals) == drafted(eager) and len(proposals) > 40


def test_graphed_draft_model_steps_draft_what_eager_ones_do(tmp_path, monkeypatch):
    from ember.bench.spec_drafts import truncated_draft

    _target(tmp_path / "target")
    truncated_draft(tmp_path / "target", tmp_path / "draft", 3)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    args = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, seed=0, speculative_config=spec)
    graphed = LLM(str(tmp_path / "target"), **args)
    graphs, rows = graphed.engine.runner.drafter.graphs, []
    assert graphs is not None
    replay = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *a, **k: rows.append(len(ids)) or replay(ids, *a, **k))
    eager = LLM(str(tmp_path / "target"), enforce_eager=True, **args)
    assert eager.engine.runner.drafter.graphs is None
    tokens, proposals = drafted(graphed)
    assert (tokens, proposals) == drafted(eager) and len(proposals) > 40
    assert len(PROMPTS) in rows  # draft positions (and decode steps): a row a request
    assert max(rows) > len(PROMPTS)  # steps verifying drafts: a token a row
