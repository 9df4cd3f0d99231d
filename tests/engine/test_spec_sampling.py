"""Speculative sampling at temperature > 0: the draft_model and eagle3 drafters draw each draft
from their own q under the request's sampling parameters and the target keeps it with
probability min(1, p / q) (runner/sampler.py `verify_drafts`).

The default model drafting for itself: on its batch-invariant CPU path q is p bit for bit, so
every draft is kept. A tiny random Llama (float32, saved by transformers) with drafters of lower
quality, its own first 2 of 8 layers (an early exit) and a random EAGLE-3 head: q keeps more
drafts than greedy drafts verified as point masses on the same requests, and the tokens at the
first drafted position are distributed as without speculation."""

from __future__ import annotations

import pytest
from eagle3_heads import write_tiny_drafters
from invariance import results
from sampling import chi2_pvalue

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b):\n    return",
           "Write a short story about a robot who learns to paint by the sea.", "1 1 1 1 1 1 1 1 1 1 1 1 1",
           "Sing along: na na na na na na na na na na na na na na"]  # the last two: drafts that repeat a draft


def test_the_default_model_drafting_for_itself_keeps_every_draft(gguf_path, live_engines):
    """Temperature 0.8 with top-k, top-p, min-p and a frequency penalty over the output, whose
    earlier drafts count (without them a drafter's q would differ from p where it drafts a token
    again, which the repetitive prompts do): q = p at every drafted position, so no draft is
    ever rejected (greedy drafts verified as point masses keep 29% here). The same seeds give the
    same tokens again, and each token's logprob is the target's (scoring the same text)."""
    spec = LLM(str(gguf_path), speculative_config={"model": str(gguf_path), "num_speculative_tokens": 3})
    live_engines.append(spec)
    try:
        tok = spec.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(t)} for t in PROMPTS]
        params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.02, frequency_penalty=0.3,
                                 max_tokens=16, ignore_eos=True, seed=i, logprobs=0) for i in range(len(prompts))]
        counts = spec.engine.scheduler.spec
        got = spec.generate(prompts, params)
        assert counts.num_draft_tokens > 3 * len(prompts) * 3  # every step drafted (fewer near max_tokens)
        assert counts.num_accepted_tokens == counts.num_draft_tokens
        assert results(spec.generate(prompts, params)) == results(got)
        scored = spec.generate([{"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids)}
                                for o in got], SamplingParams(max_tokens=1, prompt_logprobs=0))
        for o, s in zip(got, scored):
            n = len(o.outputs[0].token_ids)
            want = [next(iter(lp.values())).logprob for lp in s.prompt_logprobs[-n:]]
            have = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            assert have == pytest.approx(want, abs=1e-5)
    finally:
        live_engines.remove(spec)


ENGINE = dict(dtype="float32", block_size=8, num_kv_blocks=1024, max_model_len=16, max_num_seqs=256,
              max_num_batched_tokens=2048)  # every request in one step, drafts and all
N = 240  # seeded requests a run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """eagle3_heads.write_tiny_drafters' target (peaked distributions: a drafter that ignores p
    is told apart) and drafters."""
    root = tmp_path_factory.mktemp("tiny-spec")
    write_tiny_drafters(root)
    return root


class Drafter:
    """The engine's drafter (the model runner), its drafts sampled from q (`sample`) or the argmax
    as point masses; it records each request's first draft after its first token."""

    def __init__(self, runner, sample: bool) -> None:
        self.runner, self.sample, self.first = runner, sample, []

    def propose_for(self, requests):
        drafts = self.runner.propose_for(requests, sample=self.sample)
        self.first += [d[0] for r, d in zip(requests, drafts) if d and len(r.output_token_ids) == 1]
        return drafts


def _pooled(a: dict[int, int], b: dict[int, int], least: int = 10) -> list[list[int]]:
    """The 2 x C table of two samples' counts, tokens seen fewer than `least` times in both
    together pooled into one cell (Pearson's statistic wants expected counts of about 5 a cell)."""
    cells = sorted(set(a) | set(b))
    small = [c for c in cells if a.get(c, 0) + b.get(c, 0) < least]
    table = [[x.get(c, 0) for c in cells if c not in small] + [sum(x.get(c, 0) for c in small)] for x in (a, b)]
    return [row[:-1] for row in table] if not small else table


def _counts(tokens: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tokens:
        out[t] = out.get(t, 0) + 1
    return out


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_weaker_drafter_keeps_more_drafts_with_q_and_the_targets_distribution(tiny, live_engines, method):
    """240 requests seeded 0..239, temperature 1, 3 tokens: the first from the prompt alone, the
    second the first drafted position. Drafts from q are kept more than twice as often as the
    argmax verified as a point mass on the same requests (0.267 against 0.067 with the early exit,
    0.096 against 0.029 with the head). The second tokens are distributed as without
    speculation: a chi-square test of the two samples, cells of fewer than 10 tokens pooled. The
    seeds are fixed, so it is deterministic; p > 0.01 is a bound an exact sampler misses for 1%
    of seed sets (the runs share their first tokens, drawn by the same seeds, which makes the
    test conservative). It is not blind: the drafts themselves, what keeping every draft would
    give, are told apart from the plain run's tokens (p < 1e-6; here 1e-14 and 1e-75), while the
    tokens kept give p = 0.82 and 0.22."""
    plain = LLM(str(tiny / "target"), **ENGINE)
    model = tiny / ("early_exit" if method == "draft_model" else "eagle3")
    spec = LLM(str(tiny / "target"), **ENGINE,
               speculative_config={"method": method, "model": str(model), "num_speculative_tokens": 3})
    live_engines += [plain, spec]
    try:
        prompts = [{"prompt_token_ids": [5, 9, 9, 2, 7, 1]}] * N
        params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i) for i in range(N)]
        counts = spec.engine.scheduler.spec
        rates = {}
        for sample in (True, False):
            spec.engine.proposer = drafter = Drafter(spec.engine.runner, sample)
            before = counts.num_draft_tokens, counts.num_accepted_tokens
            got = spec.generate(prompts, params)
            drafted, accepted = counts.num_draft_tokens - before[0], counts.num_accepted_tokens - before[1]
            assert drafted >= N  # every request drafted at its second token
            rates[sample] = accepted / drafted
            if sample:
                second = _counts([o.outputs[0].token_ids[1] for o in got])
                blind = _counts(drafter.first)
        want = _counts([o.outputs[0].token_ids[1] for o in plain.generate(prompts, params)])
        assert rates[True] > 2 * rates[False], rates
        assert chi2_pvalue(_pooled(want, second)) > 0.01, (want, second)
        assert chi2_pvalue(_pooled(want, blind)) < 1e-6, (want, blind)
    finally:
        for llm in (plain, spec):
            live_engines.remove(llm)


def test_the_drafts_probabilities_are_kept_out_of_the_kv_pool(gguf_path):
    """q rows are float32 vocabularies, K a request: on CUDA the pool is sized without them."""
    import types

    from ember import EngineConfig
    from ember.runner.model_runner import ModelRunner

    def held(drafter, **spec) -> int:
        cfg = EngineConfig(model=str(gguf_path), max_num_seqs=256, speculative_config={
            "method": "draft_model", "model": str(gguf_path), "num_speculative_tokens": 4, **spec}).resolve()
        return ModelRunner.draft_probs_bytes.fget(types.SimpleNamespace(config=cfg, drafter=drafter))

    assert held(object()) == 4 * 256 * 49152 * 4
    assert held(object(), disable_by_batch_size=8) == 4 * 8 * 49152 * 4
    assert held(None) == 0
