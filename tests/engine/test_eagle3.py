"""Speculative decoding with EAGLE-3 heads (`{"method": "eagle3", "model": HEAD}`), heads written
in the layout vLLM and SGLang load. A tiny random Llama target (float32) saved by transformers:
every step's drafts equal a plain-torch EAGLE-3 forward over transformers' hidden states of the
same tokens, and the output is the output without speculation. The default model (SmolLM2, its
batch-invariant path) with a random head sharing its embeddings: greedy tokens and logprobs bit
for bit the plain engine's, through forks, a prefix hit, preemption and an abort."""

from __future__ import annotations

import pytest
from eagle3_heads import mode_head, reference_drafts, speculators_layout
from engine_steps import abort_one_when
from invariance import assert_same, results
from sampling import greedy

from ember import LLM, SamplingParams
from ember.bench.dummy_eagle3 import head_config, random_head, save_head
from ember.request import Request

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

AUX = [1, 4, 6]  # of the tiny target's 8 layers
ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=96, max_model_len=256)
PROMPTS = [[5, 9, 9, 9, 2, 9, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [7]]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    made = {}
    config = head_config(64, 64, 32, AUX)  # half the vocabulary drafts (d2t), its own embeddings
    made["random"] = config, random_head(config, seed=1, embed=True)
    config = head_config(64, 64, 64, AUX, heads=4, kv_heads=4)
    made["mode"] = config, mode_head(config)
    heads = {name: (save_head(root / name, c, t), c, t) for name, (c, t) in made.items()}
    config, tensors = made["random"]
    outer, renamed = speculators_layout(config, tensors)  # the reference reads vLLM's names and the flag
    heads["speculators"] = save_head(root / "speculators", outer, renamed), config | {"norm_before_residual": True}, \
        tensors
    return heads


@pytest.fixture(scope="module")
def plain(eagle3_target, live_engines):
    llm = LLM(str(eagle3_target[0]), **ENGINE)
    live_engines.append(llm)
    yield llm
    live_engines.remove(llm)


def drive(llm: LLM, prompts: list[list[int]],
          max_tokens: int | list[int]) -> tuple[list[list[int]], list[tuple[list[int], list[int]]], int]:
    """The requests through the engine core step by step: each one's tokens, every (context,
    drafts) a step proposed, and the steps with drafting off (more running than disable_by_batch_size)."""
    core = llm.engine
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    reqs = [Request(f"e3-{i}", p, greedy(n, ignore_eos=True)) for i, (p, n) in enumerate(zip(prompts, counts))]
    for r in reqs:
        core.add_request(r)
    proposed, off_steps = [], 0
    limit = core.config.speculative_config.disable_by_batch_size
    while core.has_unfinished_requests():
        core.step()
        drafted = [(list(r.all_token_ids), list(r.draft_token_ids)) for r in reqs if r.draft_token_ids]
        if limit is not None and len(core.scheduler.running) > limit:
            assert not drafted
            off_steps += 1
        proposed += drafted
    core.check_idle()
    return [list(r.output_token_ids) for r in reqs], proposed, off_steps


@pytest.mark.parametrize("name, off_above", [("random", None), ("mode", None), ("speculators", None),
                                             ("random", 2)])
def test_drafts_are_the_reference_heads_and_the_tokens_the_targets(eagle3_target, heads, plain, live_engines, name,
                                                                   off_above):
    """off_above 2: no drafts while 3 requests run (the head still follows every row), then drafts."""
    path, config, tensors = heads[name]
    spec = LLM(str(eagle3_target[0]), **ENGINE, max_num_batched_tokens=12,  # prompts in chunks
               speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": 3,
                                   "disable_by_batch_size": off_above})
    live_engines.append(spec)
    try:
        lengths = [40, 24, 12] if off_above else [40] * 3
        want = [list(o.outputs[0].token_ids)[:n] for o, n in zip(plain.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], greedy(40, ignore_eos=True)), lengths)]
        got, proposed, off_steps = drive(spec, PROMPTS, [40, 24, 12] if off_above else 40)
        assert got == want
        assert len(proposed) > (10 if off_above else 30)
        assert (off_steps >= 5) if off_above else off_steps == 0  # drafting off while all three ran
        for context, drafts in proposed:
            assert drafts == reference_drafts(eagle3_target[1], config, tensors, AUX, context, len(drafts)), context
        counts = spec.engine.scheduler.spec
        if name == "mode":  # the tiny target repeats itself: whole runs of drafts accepted, so a step keeps 4 rows
            assert counts.accepted_per_position[2] > 0
        draft_ids = {t for _, drafts in proposed for t in drafts}
        if name != "mode":  # target ids of the draft vocabulary only (every second one)
            assert draft_ids and all(t % 2 == 0 for t in draft_ids)
        assert spec.engine.runner.drafter.pending == {}
    finally:
        live_engines.remove(spec)


@pytest.fixture(scope="module")
def default_head(tmp_path_factory, gguf_path):
    """A random head for the default model: its 576-wide hidden states, no embedding of its own
    (it embeds with the target's), 4096 of the 49152 ids as its vocabulary."""
    config = head_config(576, 49152, 4096, None, heads=4, kv_heads=2, intermediate=256)
    return save_head(tmp_path_factory.mktemp("smol-head"), config, random_head(config, seed=2, embed=False))


def test_the_default_model_with_a_head_gives_its_own_tokens(gguf_path, default_head, live_engines):
    plain = LLM(str(gguf_path))
    spec = LLM(str(gguf_path), speculative_config={"method": "eagle3", "model": str(default_head),
                                                   "num_speculative_tokens": 3})
    live_engines += [plain, spec]
    try:
        assert spec.engine.runner.drafter.aux_layers == (2, 15, 27)  # 30 layers: the default choice
        tok = plain.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(t)} for t in
                   ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b):\n    return",
                    "Three primary colors of light are"]]
        params = greedy(32, ignore_eos=True, logprobs=0)
        assert_same(results(spec.generate(prompts, params)), results(plain.generate(prompts, params)), "eagle3")
        assert spec.engine.scheduler.spec.num_drafts > 0
        forks = SamplingParams(temperature=0, max_tokens=10, n=2, ignore_eos=True)
        want = plain.generate(prompts[:1], forks)[0].outputs
        got = spec.generate(prompts[:1], forks)[0].outputs  # its prompt's blocks from the prefix cache
        assert [list(c.token_ids) for c in got] == [list(c.token_ids) for c in want]
        spec.engine.check_idle()
    finally:
        for llm in (plain, spec):
            live_engines.remove(llm)


def test_preempted_and_aborted_requests_hold_no_block(gguf_path, default_head, live_engines):
    """14 blocks for three requests that grow to 6 each: preemptions mid-draft; an abort."""
    spec = LLM(str(gguf_path), speculative_config={"method": "eagle3", "model": str(default_head),
                                                   "num_speculative_tokens": 3}, num_kv_blocks=14, max_model_len=96)
    plain = LLM(str(gguf_path), num_kv_blocks=64, max_model_len=96)
    live_engines += [spec, plain]
    try:
        tok = plain.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(f"Count with me: {', '.join(map(str, range(i, i + 14)))}")[:60]}
                   for i in range(3)]
        params = greedy(30, ignore_eos=True, logprobs=0)
        assert_same(results(spec.generate(prompts, params)), results(plain.generate(prompts, params)), "preempted")
        assert spec.engine.scheduler.num_preemptions > 0
        core = spec.engine
        reqs = [Request(f"ab-{i}", p["prompt_token_ids"], greedy(30, ignore_eos=True)) for i, p in enumerate(prompts)]
        gone = abort_one_when(core, reqs, lambda r: bool(r.draft_token_ids))
        assert gone.finish_reason == "abort" and gone.block_ids == []
        assert all(len(r.output_token_ids) == 30 for r in reqs if r is not gone)
        assert core.runner.drafter.pending == {}
        core.check_idle()
    finally:
        for llm in (spec, plain):
            live_engines.remove(llm)


def test_heads_that_do_not_fit_the_target_are_refused(eagle3_target, heads, tmp_path, gguf_path):
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="method 'eagle3' needs an EAGLE-3 head"):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec | {"model": str(eagle3_target[0])})
    with pytest.raises(ValueError, match="is for a vocabulary of 64 tokens and the target's has 49152"):
        LLM(str(gguf_path), speculative_config=spec | {"model": str(heads["random"][0])})
    wide = head_config(64, 64, 32, AUX, target_hidden=128)
    save_head(tmp_path / "wide", wide, random_head(wide, seed=3, embed=True))
    with pytest.raises(ValueError, match="reads hidden states of 128 and the target's are 64"):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec | {"model": str(tmp_path / "wide")})
    bad = head_config(64, 64, 32, [1, 4, 8])
    save_head(tmp_path / "bad", bad, random_head(bad, seed=3, embed=True))
    with pytest.raises(ValueError, match=r"names target layers \[1, 4, 8\]"):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec | {"model": str(tmp_path / "bad")})
    two = heads["random"][1] | {"num_hidden_layers": 2}
    save_head(tmp_path / "two", two, heads["random"][2])
    with pytest.raises(ValueError, match="has 2 layers"):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec | {"model": str(tmp_path / "two")})
    with pytest.raises(ValueError, match="method 'eagle3' needs \"model\""):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec)
    with pytest.raises(ValueError, match="does not keep an EAGLE-3 head's pending features of a swapped-out request"):
        LLM(str(eagle3_target[0]), **ENGINE, speculative_config=spec | {"model": str(heads["random"][0])},
            preemption_mode="swap", swap_space=0.01)
