"""Greedy drafts on the device: where every request drafting is a plain greedy one (or
propose_for(sample=False)), the draft_model and eagle3 drafters feed each position's argmax to
the next on the device and read the drafts back once. A tiny random Llama target (float32) with
its own first 2 layers as a draft model and a random EAGLE-3 head over half its vocabulary: each
step's drafts equal those of the per-position path (a SamplingRow a request, sampler.draft), and
a batch with a penalised or sampling request takes the per-position path."""

from __future__ import annotations

import pytest
from eagle3_heads import write_tiny_drafters

from ember import LLM, SamplingParams
from ember.runner import model_runner

ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=128, max_model_len=64)
PROMPTS = [[5, 9, 9, 2, 7, 1], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [7], [3, 4] * 6]
DRAFTS = {"draft_model": "early_exit", "eagle3": "eagle3"}  # write_tiny_drafters' directories
MAX_TOKENS = [6, 11, 17, 24]  # the requests stop drafting at different steps: limits differ in one propose


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("greedy-drafts")
    write_tiny_drafters(root)
    return root


@pytest.fixture(scope="module", params=["draft_model", "eagle3"])
def spec(request, tiny):
    method = request.param
    return LLM(str(tiny / "target"), **ENGINE, speculative_config={"method": method, "model": str(tiny / DRAFTS[method]),
                                                                   "num_speculative_tokens": 4})


class Twice:
    """The engine's proposer: each step drafts once by `first` (the EAGLE-3 head's pending rows
    restored after it; the drafter's KV is written again), then as the engine would, whose drafts
    it returns. `steps`: each one's requests, limits, whether the engine's drafts were drafted on
    the device, `first`'s drafts, the engine's, and the requests whose q the runner keeps."""

    def __init__(self, runner, monkeypatch, first) -> None:
        self.runner, self.first, self.steps, self.paths = runner, first, [], []
        propose = runner.drafter.propose

        def spy(requests, limits, tables, draw):
            self.paths.append((list(limits), draw is None))
            return propose(requests, limits, tables, draw)

        monkeypatch.setattr(runner.drafter, "propose", spy)

    def propose_for(self, requests):
        drafter = self.runner.drafter
        pending = dict(getattr(drafter, "pending", {}))
        first = self.first(requests)
        if hasattr(drafter, "pending"):
            drafter.pending.clear()
            drafter.pending.update(pending)
        drafts = self.runner.propose_for(requests)
        limits, on_device = self.paths[-1]
        kept_q = {r.request_id for r in requests if r.request_id in self.runner.draft_probs}
        self.steps.append((requests, limits, on_device, first, drafts, kept_q))
        return drafts


def run(llm: LLM, monkeypatch, first, params: list[SamplingParams]) -> list[tuple]:
    twice = Twice(llm.engine.runner, monkeypatch, first)
    monkeypatch.setattr(llm.engine, "proposer", twice)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return twice.steps


@pytest.mark.slow
def test_greedy_drafts_on_the_device_are_the_per_position_paths(spec, monkeypatch):
    """Greedy requests of different max_tokens: every propose drafts on the device, and its
    drafts are exactly those of the per-position path (forced) over the same requests."""
    runner = spec.engine.runner

    def per_position(requests):
        with monkeypatch.context() as m:
            m.setattr(model_runner, "_raw_argmax", lambda req, n: False)
            return runner.propose_for(requests)

    steps = run(spec, monkeypatch, per_position,
                [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    assert all(on_device for _, _, on_device, _, _, _ in steps)
    for _, _, _, first, drafts, _ in steps:
        assert drafts == first
    assert sum(len(d) for step in steps for d in step[4]) > 40
    assert any(len({n for n in limits if n > 0}) > 1 for _, limits, *_ in steps)  # limits 1 to 4 in one propose


@pytest.mark.slow
@pytest.mark.parametrize("other", [dict(temperature=0, repetition_penalty=3.0), dict(temperature=1.0, seed=7)],
                         ids=["penalised", "sampling"])
def test_a_batch_with_a_penalised_or_sampling_request_drafts_per_position(spec, monkeypatch, other):
    """Plain greedy requests beside one that is penalised or samples: every propose it drafts in
    takes the per-position path; the plain requests' drafts are still the argmax drafted on the
    device (propose_for(sample=False) over the same requests), and the other one's its own: the
    penalised one's differ from the argmax somewhere, the sampling one's q is kept."""
    runner = spec.engine.runner
    params = [SamplingParams(**dict(temperature=0, max_tokens=n, ignore_eos=True) | (other if i == 1 else {}))
              for i, n in enumerate(MAX_TOKENS)]
    steps = run(spec, monkeypatch, lambda requests: runner.propose_for(requests, sample=False), params)
    mixed = 0
    differs = False
    for requests, limits, on_device, raw, drafts, kept_q in steps:
        others = [i for i, r in enumerate(requests) if r.sampling_params is params[1] and limits[i] > 0]
        if not others:
            continue
        mixed += 1
        assert not on_device
        for i, (a, b) in enumerate(zip(raw, drafts)):
            if i in others:
                differs |= a != b
                assert (requests[i].request_id in kept_q) == (other["temperature"] > 0)
            else:
                assert a == b
    assert mixed > 3
    if other["temperature"] == 0:
        assert differs
