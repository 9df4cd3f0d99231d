"""Speculative decoding with async scheduling on (forced on the CPU): a step that verifies drafts,
or whose requests are asked for their next drafts, is collected before the next schedule; above
disable_by_batch_size (2 here) no request drafts and the steps run async. On the default model's
batch-invariant path greedy tokens and their logprobs equal the synchronous engine's bit for bit
while the batch crosses the limit both ways, through aborts, stop strings, n > 1 and a grammar
that cuts the drafts; with prompt lookup, a draft model and an EAGLE-3 head (whose drafts equal
the plain-torch reference head's: its KV followed the async steps' pending tokens)."""

from __future__ import annotations

import pytest
from eagle3_heads import reference_drafts
from sampling import greedy
from test_speculative import GROUNDED as SPEC_GROUNDED

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.bench.dummy_eagle3 import head_config, random_head, save_head
from ember.request import Request

pytestmark = pytest.mark.slow

LIMIT = 2  # disable_by_batch_size: drafts while at most two requests run
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "disable_by_batch_size": LIMIT}
GROUNDED = [SPEC_GROUNDED[0], SPEC_GROUNDED[2]]  # the code to copy, the repeated sentence
OPEN = ["Write a short story about a robot who learns to paint by the sea.", "The three primary colors of light are"]
PERSON = '{"name": "Ada Lovelace", "age": 36, "city": "London"}'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}


@pytest.fixture(scope="module")
def engines(gguf_path, live_engines):
    made = {"sync": LLM(str(gguf_path), speculative_config=SPEC),
            "async": LLM(str(gguf_path), speculative_config=SPEC, async_scheduling=True)}
    live_engines.extend(made.values())
    yield made
    for llm in made.values():
        live_engines.remove(llm)


class Schedules:
    """Each schedule of a core: (requests running before it, whether a token of theirs was
    pending then: a step in flight, whether the plan verifies drafts). No drafts ride on a
    pending token."""

    def __init__(self, core, monkeypatch) -> None:
        self.records: list[tuple[int, bool, bool]] = []
        schedule = core.scheduler.schedule

        def spy():
            running = core.scheduler.running
            before = len(running), any(r.num_pending_tokens for r in running)
            plan = schedule()
            drafted = [c for c in plan.chunks if c.draft_token_ids]
            assert not any(c.request.num_pending_tokens for c in drafted), "drafts after a pending token"
            self.records.append((*before, bool(drafted)))
            return plan

        monkeypatch.setattr(core.scheduler, "schedule", spy)

    def check_crossing(self, min_async: int) -> None:
        """Schedules with a step in flight came only above the limit, at least `min_async` of them,
        and steps verified drafts both before and after them (the batch crossed the limit both ways)."""
        overlapped = [i for i, (_, pending, _) in enumerate(self.records) if pending]
        verified = [i for i, (_, _, drafts) in enumerate(self.records) if drafts]
        assert len(overlapped) >= min_async and all(self.records[i][0] > LIMIT for i in overlapped)
        assert verified and min(verified) < min(overlapped) and max(verified) > max(overlapped)


def crossing(tok, prompts=None) -> dict[int, list[Request]]:
    """Two requests that draft, two more arriving at step call 6 (drafting off while the four
    run), finishing long before the first two (which draft again)."""
    ids = [tok.encode(p) for p in GROUNDED + OPEN] if prompts is None else prompts
    return {0: [Request("a", ids[0], greedy(64, ignore_eos=True, logprobs=0)),
                Request("b", ids[1], greedy(64, ignore_eos=True, logprobs=0))],
            6: [Request("c", ids[2], greedy(12, ignore_eos=True, logprobs=0)),
                Request("d", ids[3], greedy(10, ignore_eos=True, logprobs=0))]}


def drive(llm: LLM, arrivals: dict[int, list[Request]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Step the core to the end, adding arrivals[k] and aborting aborts[k] before step call k;
    each request's (token, logprob) as its outputs gave them."""
    core, k, got = llm.engine, 0, {}
    while k <= max(arrivals) or core.has_unfinished_requests():
        for r in arrivals.get(k, []):
            core.add_request(r)
        for request_id in (aborts or {}).get(k, []):
            core.abort_request(request_id)
        for out in core.step():
            got.setdefault(out.request_id, [])
            got[out.request_id] += [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.logprobs or [],
                                                                     strict=True)]
        k += 1
    for reqs in arrivals.values():
        for r in reqs:
            assert [t for t, _ in got.get(r.request_id, [])] == r.output_token_ids
    return got


@pytest.fixture(scope="module")
def reference(engines):
    """The crossing run on the synchronous engine."""
    return drive(engines["sync"], crossing(engines["sync"].get_tokenizer()))


def test_the_batch_crossing_the_limit_both_ways_equals_sync(engines, reference, monkeypatch):
    llm = engines["async"]
    counts = llm.engine.scheduler.spec
    before = counts.num_drafts, counts.num_accepted_tokens
    schedules = Schedules(llm.engine, monkeypatch)
    assert drive(llm, crossing(llm.get_tokenizer())) == reference
    assert [len(reference[r]) for r in "abcd"] == [64, 64, 12, 10]
    schedules.check_crossing(min_async=8)
    assert counts.num_drafts - before[0] > 5 and counts.num_accepted_tokens - before[1] > 10


def test_aborts_in_either_phase(engines, reference):
    """"c" aborted while four run (async), "a" while it drafts (synchronous steps): each keeps a
    prefix of its whole run, the others their whole run, bit for bit; nothing is left behind."""
    tok = engines["sync"].get_tokenizer()
    for llm in engines.values():
        got = drive(llm, crossing(tok), aborts={9: ["c"], 20: ["a"]})
        for r in "ac":
            assert 0 < len(got[r]) < len(reference[r]) and got[r] == reference[r][:len(got[r])], r
        assert {r: got[r] for r in "bd"} == {r: reference[r] for r in "bd"}


@pytest.fixture(scope="module")
def small_budget(gguf_path, live_engines):
    """16 tokens a step: a newcomer's prefill takes what two decodes leave."""
    made = {name: LLM(str(gguf_path), speculative_config=SPEC, max_num_batched_tokens=16,
                      async_scheduling=name == "async") for name in ("sync", "async")}
    live_engines.extend(made.values())
    yield made
    for llm in made.values():
        live_engines.remove(llm)


def test_drafts_a_full_step_leaves_out_go_stale(small_budget, monkeypatch):
    """"a" and "b" draft when "c" arrives; its prefill takes the budget their drafts would
    have used, so that step verifies none and, three running, the next one is scheduled while
    it is in flight: the drafts, which followed a token before the pending one, stay out of it."""
    tok = small_budget["sync"].get_tokenizer()
    got = {}
    for name, llm in small_budget.items():
        core = llm.engine
        a, b = (Request(r, tok.encode(p), greedy(40, ignore_eos=True, logprobs=0)) for r, p in zip("ab", GROUNDED))
        c = Request("c", tok.encode(OPEN[0]), greedy(8, ignore_eos=True, logprobs=0))
        assert len(c.prompt_token_ids) > 14
        launched = []
        launch = core.runner.launch

        def spy_launch(plan, *args):
            launched.append({ch.request.request_id for ch in plan.chunks if ch.draft_token_ids})
            return launch(plan, *args)

        monkeypatch.setattr(core.runner, "launch", spy_launch)
        for r in (a, b):
            core.add_request(r)
        while not launched or launched[-1] != {"a", "b"}:  # until both verify drafts, then draft again
            core.step()
        if name == "async":
            schedules = Schedules(core, monkeypatch)
        core.add_request(c)
        while core.has_unfinished_requests():
            core.step()
        got[name] = [r.output_token_ids for r in (a, b, c)]
    assert got["async"] == got["sync"]
    assert schedules.records[0][2] is False  # the step with c's prefill verified no draft
    assert schedules.records[1][1]  # and the next was scheduled while it was in flight


def outputs(outs) -> list:
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs] for o in outs]


def cases(tok) -> dict[str, tuple[list, list]]:
    copy_person = f"Copy this JSON exactly: {PERSON}\nCopy: {PERSON}\nCopy again:"
    return {
        "stop strings": ([GROUNDED[0], GROUNDED[0]], [greedy(48, stop=["left[i]"], logprobs=0),
                                                      greedy(48, stop=["i += 1"], logprobs=0)]),
        "n > 1": ([GROUNDED[0]], [SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)]),
        "structured output": ([copy_person], [greedy(40, logprobs=0,
                                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))]),
    }


@pytest.mark.parametrize("case", ["stop strings", "n > 1", "structured output"])
def test_features_beside_requests_crossing_the_limit_equal_sync(engines, monkeypatch, case):
    """Each case beside two short greedy requests (drafting off until they finish)."""
    sync, llm = engines["sync"], engines["async"]
    special, params = cases(sync.get_tokenizer())[case]
    prompts = special + OPEN
    params = params + [greedy(8, ignore_eos=True, logprobs=0), greedy(6, ignore_eos=True, logprobs=0)]
    want = sync.generate(prompts, params)
    verified: list[str] = []
    launch = llm.engine.runner.launch

    def spy_launch(plan, *args):
        verified.extend(c.request.request_id for c in plan.chunks if c.draft_token_ids)
        return launch(plan, *args)

    monkeypatch.setattr(llm.engine.runner, "launch", spy_launch)
    schedules = Schedules(llm.engine, monkeypatch)
    got = llm.generate(prompts, params)
    assert outputs(got) == outputs(want)
    if case != "structured output":  # a grammar makes each step it samples in synchronous
        assert any(pending for _, pending, _ in schedules.records)  # some steps ran async
    assert all(n > LIMIT for n, pending, _ in schedules.records if pending)
    first = got[0].request_id
    assert any(r == first or r.startswith(f"{first}#") for r in verified)  # the special request verified drafts
    if case == "stop strings":
        assert [o.outputs[0].stop_reason for o in got[:2]] == ["left[i]", "i += 1"]
    if case == "n > 1":
        assert len(got[0].outputs) == 2
    if case == "structured output":
        assert got[0].outputs[0].text.strip() == PERSON and got[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("draft", ["itself", "tiny random"])
def test_a_draft_model_crossing_the_limit_equals_sync(engines, reference, gguf_path, tiny_draft, live_engines,
                                                      monkeypatch, draft):
    """The draft model follows every step, async ones too (their input ids gathered on the
    device), and drafts only after synchronous ones. The reference is prompt lookup's
    synchronous run: on this path every speculating engine's greedy output is the plain
    engine's, bit for bit (test_speculative.py)."""
    path = gguf_path if draft == "itself" else tiny_draft
    llm = LLM(str(gguf_path), async_scheduling=True,
              speculative_config={"model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": LIMIT})
    live_engines.append(llm)
    try:
        schedules = Schedules(llm.engine, monkeypatch)
        assert drive(llm, crossing(llm.get_tokenizer())) == reference
        schedules.check_crossing(min_async=8)
        counts = llm.engine.scheduler.spec
        rate = counts.num_accepted_tokens / counts.num_draft_tokens
        assert rate > 0.8 if draft == "itself" else rate < 0.5, rate
    finally:
        live_engines.remove(llm)


AUX = [1, 4, 6]  # of the tiny target's 8 layers
TINY = dict(dtype="float32", block_size=8, num_kv_blocks=96, max_model_len=256)
TINY_PROMPTS = [[5, 9, 9, 9, 2, 9, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
                [7, 3, 11], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def eagle3(eagle3_target, tmp_path_factory):
    """The tiny random Llama target (float32, transformers') and a random EAGLE-3 head for it."""
    target, model = eagle3_target
    head = head_config(64, 64, 32, AUX)
    tensors = random_head(head, seed=1, embed=True)
    return target, model, save_head(tmp_path_factory.mktemp("head"), head, tensors), head, tensors


def test_an_eagle3_head_crossing_the_limit_equals_sync(eagle3, live_engines, monkeypatch):
    """Above the limit the head's rows that wait for a sampled token run at the next step's
    follow while that token is still pending (read on the device); its drafts after the batch
    shrinks are still the reference head's over transformers' hidden states."""
    target, model, head, config, tensors = eagle3
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "disable_by_batch_size": LIMIT}
    made = {name: LLM(str(target), **TINY, speculative_config=spec, async_scheduling=name == "async")
            for name in ("sync", "async")}
    live_engines.extend(made.values())
    try:
        want = drive(made["sync"], crossing(None, TINY_PROMPTS))
        core = made["async"].engine
        schedules = Schedules(core, monkeypatch)
        proposed = []
        propose = core._propose

        def spy_propose(stepped):
            propose(stepped)
            proposed.extend((list(r.all_token_ids), list(r.draft_token_ids)) for r in stepped if r.draft_token_ids)

        monkeypatch.setattr(core, "_propose", spy_propose)
        assert drive(made["async"], crossing(None, TINY_PROMPTS)) == want
        schedules.check_crossing(min_async=8)
        late = proposed[-10:]  # drafting again after the async steps
        assert len(late) == 10
        for context, drafts in late:
            assert drafts == reference_drafts(model, config, tensors, AUX, context, len(drafts)), context
        assert core.runner.drafter.pending == {}
    finally:
        for llm in made.values():
            live_engines.remove(llm)
