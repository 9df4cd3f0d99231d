"""Speculative decoding (n-gram prompt lookup) on the path users get: the default model (SmolLM2
GGUF Q4_1) at its default settings on the CPU, whose steps are batch-invariant (a request's logits'
bits do not depend on what shares its step: test_default_path_invariance.py). So with
speculation every greedy token and the logprob of each equal those without it, bit for bit,
whether the drafts are right, wrong or mixed; sampled tokens keep the model's distribution.

Drafts that are always right or always wrong come from an oracle proposer that reads the plain
engine's outputs (the engine's own n-gram proposer gives the mixed case)."""

from __future__ import annotations

import pytest
from invariance import assert_same, results
from sampling import chi2_pvalue, greedy

from ember import LLM, SamplingParams
from ember.request import Request
from ember.sampling_params import StructuredOutputsParams
from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.proposer import Proposer

pytestmark = pytest.mark.slow

CODE = '''def merge(left, right):
    out = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    return out + left[i:] + right[j:]
'''
GROUNDED = [  # the output repeats the input: where prompt lookup pays
    "Copy this code exactly:\n\n" + CODE + "\nCopy:\n\n" + CODE[:60],
    "Rename `out` to `merged` in this code:\n\n" + CODE + "\nWith the new name:\n\ndef merge(left, right):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
OPEN = ["Write a short story about a robot who learns to paint by the sea.",  # drafts mostly wrong
        "The three primary colors of light are"]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def engines(gguf_path, live_engines):
    made = {"plain": LLM(str(gguf_path)), "spec": LLM(str(gguf_path), speculative_config=SPEC)}
    live_engines.extend(made.values())
    yield made
    for llm in made.values():
        live_engines.remove(llm)


def token_prompts(llm: LLM, texts: list[str]) -> list[dict]:
    return [{"prompt_token_ids": llm.get_tokenizer().encode(t)} for t in texts]


class Oracle(Proposer):
    """Drafts from known continuations: the next k tokens of the reference sequence the context
    is a prefix of (`wrong`: each shifted by one, never the model's)."""

    def __init__(self, sequences: list[list[int]], k: int, wrong: bool = False) -> None:
        self.sequences, self.k, self.wrong = sequences, k, wrong

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        for seq in self.sequences:
            if seq[:len(token_ids)] == token_ids:
                drafts = seq[len(token_ids): len(token_ids) + (k or self.k)]
                return [t + 1 for t in drafts] if self.wrong else drafts
        return []


@pytest.fixture
def oracle(engines):
    spec = engines["spec"].engine
    own = spec.proposer

    def use(proposer) -> None:
        spec.proposer = proposer

    yield use
    spec.proposer = own


def test_greedy_tokens_and_logprobs_equal_those_without_speculation(engines):
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, GROUNDED + OPEN)
    params = greedy(48, ignore_eos=True, logprobs=0)
    before = spec.engine.scheduler.spec.num_drafts, spec.engine.scheduler.spec.num_accepted_tokens
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert_same(results(got), results(want), "ngram K=4")
    counts = spec.engine.scheduler.spec
    drafts, accepted = counts.num_drafts - before[0], counts.num_accepted_tokens - before[1]
    assert drafts > 0 and 0 < accepted < 4 * drafts  # some drafts kept, some rolled back
    # the rolled-back drafts left the prefix cache as the plain engine's: every finished sequence's
    # blocks are cached, and no block of a rejected draft
    for g, w in zip(got, want):
        tokens = list(g.prompt_token_ids) + list(g.outputs[0].token_ids)
        assert spec.engine.prefix_cache.peek(tokens) == plain.engine.prefix_cache.peek(tokens) > 0


@pytest.mark.parametrize("k", [1, 8])
def test_any_number_of_drafts_gives_the_same_tokens(engines, gguf_path, k):
    spec = LLM(str(gguf_path), speculative_config=SPEC | {"num_speculative_tokens": k, "prompt_lookup_min": 1})
    try:
        prompts = token_prompts(spec, GROUNDED[:2])
        params = greedy(24, ignore_eos=True, logprobs=0)
        assert_same(results(spec.generate(prompts, params)), results(engines["plain"].generate(prompts, params)),
                    f"ngram K={k}")
        assert spec.engine.scheduler.spec.num_accepted_tokens > 0
        spec.engine.check_idle()
    finally:
        spec.shutdown()


def test_drafts_always_right_and_always_wrong(engines, oracle):
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, OPEN)
    params = greedy(20, ignore_eos=True, logprobs=0)
    want = plain.generate(prompts, params)
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in want]
    counts = spec.engine.scheduler.spec
    for wrong in (False, True):
        oracle(Oracle(sequences, 4, wrong))
        drafted, accepted = counts.num_draft_tokens, counts.num_accepted_tokens
        got = spec.generate(prompts, params)
        assert_same(results(got), results(want), f"always {'wrong' if wrong else 'right'}")
        drafted, accepted = counts.num_draft_tokens - drafted, counts.num_accepted_tokens - accepted
        assert accepted == (0 if wrong else drafted)
        # wrong: each step verifies 4 drafts (fewer near max_tokens) and adds one token; right: it adds 5
        assert drafted == (2 * (4 * 15 + 3 + 2 + 1) if wrong else 2 * (4 * 3 + 3))


@pytest.mark.parametrize("params", [
    dict(stop=["left[i]"]),  # a stop string inside an accepted run
    dict(stop_token_ids=[]),  # filled below: a stop token inside an accepted run
    dict(max_tokens=7),  # max_tokens inside an accepted run
    dict(min_tokens=12, stop_token_ids=[]),  # banned stops at the drafted positions before min_tokens
])
def test_stops_inside_an_accepted_run_end_the_request_where_they_would(engines, oracle, params):
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, GROUNDED[:1])
    base = plain.generate(prompts, greedy(30, ignore_eos=True))[0].outputs[0]
    if "stop_token_ids" in params:
        params = params | {"stop_token_ids": [base.token_ids[9]]}
    sp = SamplingParams(temperature=0, max_tokens=params.pop("max_tokens", 30), logprobs=0, **params)
    want = plain.generate(prompts, sp)
    oracle(Oracle([list(want[0].prompt_token_ids) + list(base.token_ids)], 6))
    got = spec.generate(prompts, sp)
    w, g = want[0].outputs[0], got[0].outputs[0]
    assert (g.text, list(g.token_ids), g.finish_reason, g.stop_reason) == \
        (w.text, list(w.token_ids), w.finish_reason, w.stop_reason)
    assert len(w.token_ids) < 30 or "min_tokens" in params


def test_a_mixed_batch_with_structured_output_and_n(engines):
    """n = 2 and a JSON schema (never drafted) beside a greedy request."""
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, GROUNDED[:2] + OPEN[:1])
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = [greedy(24, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(json=schema))]
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    for w, g in zip(want, got):
        assert [list(c.token_ids) for c in g.outputs] == [list(c.token_ids) for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]


def test_a_constrained_request_verifies_the_drafts_its_grammar_accepts(engines, oracle):
    """A JSON schema with drafts that are the plain run's own tokens: the grammar's mask at each
    drafted position, the whole accepted run fed to the grammar; the output is the plain one."""
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, ["Make up a person as JSON:"])
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    want = plain.generate(prompts, params)
    oracle(Oracle([list(want[0].prompt_token_ids) + list(want[0].outputs[0].token_ids)], 4))
    counts = spec.engine.scheduler.spec
    before = counts.num_accepted_tokens
    got = spec.generate(prompts, params)
    assert results(got) == results(want) and want[0].outputs[0].finish_reason == "stop"
    assert counts.num_accepted_tokens - before >= 8


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preempted_and_aborted_requests_hold_no_block(engines, gguf_path, live_engines, method):
    """A pool of 14 blocks for three requests that grow to 6 blocks each: preemptions, and the
    drafts' blocks come and go; an abort mid-run. Tokens equal the plain run's."""
    config = SPEC if method == "ngram" else {"model": str(gguf_path), "num_speculative_tokens": 3}
    small = LLM(str(gguf_path), speculative_config=config, num_kv_blocks=14, max_model_len=96)
    live_engines.append(small)
    try:
        prompts = token_prompts(small, GROUNDED)
        prompts = [{"prompt_token_ids": p["prompt_token_ids"][:60]} for p in prompts]
        params = greedy(30, ignore_eos=True, logprobs=0)
        assert_same(results(small.generate(prompts, params)), results(engines["plain"].generate(prompts, params)),
                    "preempted")
        assert small.engine.scheduler.num_preemptions > 0 and small.engine.scheduler.spec.num_accepted_tokens > 0
        core = small.engine
        reqs = [Request(f"ab-{i}", p["prompt_token_ids"], greedy(30, ignore_eos=True))
                for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        for _ in range(30):  # until a request holds drafts for its next step
            core.step()
            drafted = [r for r in reqs if r.draft_token_ids]
            if drafted:
                break
        gone = drafted[0]
        core.abort_request(gone.request_id)
        while core.has_unfinished_requests():
            core.step()
        assert gone.finish_reason == "abort" and gone.block_ids == [] and len(gone.output_token_ids) < 30
        assert all(len(r.output_token_ids) == 30 for r in reqs if r is not gone)
        core.check_idle()
    finally:
        live_engines.remove(small)


def test_sampled_tokens_keep_the_models_distribution(engines, oracle):
    """Temperature 1 over the top 3 tokens: the joint distribution of three tokens with drafts
    (the greedy path's token at each position, whatever came before) equals
    the one without, by a chi-square test at the engines' fixed seed; accepting drafts blindly
    would pile the samples on the greedy path, which the test tells apart."""
    plain, spec = engines["plain"], engines["spec"]
    prompts = token_prompts(plain, ["My favourite fruit is"])
    start = len(prompts[0]["prompt_token_ids"])
    path = list(plain.generate(prompts, greedy(3))[0].outputs[0].token_ids)

    class GreedyPathDrafts(Proposer):
        def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
            return path[len(token_ids) - start:]

    oracle(GreedyPathDrafts())
    n = 200

    def draw(llm: LLM) -> dict[tuple[int, ...], int]:
        outs = llm.generate(prompts * n, SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True))
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids)
            counts[key] = counts.get(key, 0) + 1
        return counts

    counts = spec.engine.scheduler.spec
    before = counts.num_drafts, counts.num_accepted_tokens
    want, got = draw(plain), draw(spec)
    assert counts.num_drafts - before[0] > n // 2 and counts.num_accepted_tokens > before[1]  # drafts were tested
    cells = sorted(set(want) | set(got))
    assert len(cells) >= 6  # a spread distribution
    table = [[want.get(c, 0) + 0.5 for c in cells], [got.get(c, 0) + 0.5 for c in cells]]
    assert chi2_pvalue(table) > 0.01, (want, got)
    blind: dict[tuple[int, ...], int] = {}  # what accepting every draft would give: the second token the draft's
    for (t0, _, t2), count in got.items():
        blind[(t0, path[1], t2)] = blind.get((t0, path[1], t2), 0) + count
    cells = sorted(set(want) | set(blind))
    table = [[want.get(c, 0) + 0.5 for c in cells], [blind.get(c, 0) + 0.5 for c in cells]]
    assert chi2_pvalue(table) < 1e-6


@pytest.mark.parametrize("draft", ["itself", "tiny random"])
def test_a_draft_model_drafts_and_the_output_is_the_targets(engines, gguf_path, tiny_draft, live_engines, draft):
    """--speculative-config '{"model": ...}': the default model drafting for itself (its drafts
    mostly right) and a tiny random model of its vocabulary (mostly wrong); greedy tokens and
    logprobs are the plain engine's either way, through n = 2 forks, a prefix hit and a stop."""
    path = gguf_path if draft == "itself" else tiny_draft
    spec = LLM(str(gguf_path), speculative_config={"model": str(path), "num_speculative_tokens": 3})
    live_engines.append(spec)
    try:
        prompts = token_prompts(spec, GROUNDED[:2] + OPEN[:1])
        params = greedy(24, ignore_eos=True, logprobs=0)
        assert_same(results(spec.generate(prompts, params)), results(engines["plain"].generate(prompts, params)),
                    f"draft model: {draft}")
        counts = spec.engine.scheduler.spec
        rate = counts.num_accepted_tokens / counts.num_draft_tokens
        assert counts.num_drafts > 0 and (rate > 0.8 if draft == "itself" else rate < 0.5), rate
        forks = SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True, stop=["left"])
        want = engines["plain"].generate(prompts[:1], forks)[0].outputs
        got = spec.generate(prompts[:1], forks)[0].outputs  # its prompt's blocks from the prefix cache
        assert [(list(c.token_ids), c.text) for c in got] == [(list(c.token_ids), c.text) for c in want]
        assert spec.engine.runner.drafter.kv_cache.shape[2] == spec.engine.runner.kv_cache.shape[2]
        if draft == "itself":  # every step drafts all it may, block boundary or not: the blocks for the
            # drafts' KV are reserved ahead (16-token blocks; 24 tokens after a 12-token prompt cross two)
            core = spec.engine
            req = Request("ahead", prompts[0]["prompt_token_ids"][:12], greedy(24, ignore_eos=True))
            core.add_request(req)
            while core.has_unfinished_requests():
                core.step()
                if not req.status.is_finished:
                    assert len(req.draft_token_ids) == min(3, 24 - len(req.output_token_ids) - 1)
                    assert len(req.block_ids) == -(-(req.num_computed_tokens + 3) // 16)
            assert not core.block_pool.num_in_use
    finally:
        live_engines.remove(spec)


def test_a_draft_model_of_another_vocabulary_is_refused(gguf_path, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="the draft model's vocabulary has 1000 tokens and the target's 49152"):
        LLM(str(gguf_path), speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})


def test_the_proposer_is_prompt_lookup_with_the_configured_sizes(engines):
    proposer = engines["spec"].engine.proposer
    assert isinstance(proposer, NgramProposer)
    assert (proposer.k, proposer.lookup_min, proposer.lookup_max) == (4, 2, 4)
