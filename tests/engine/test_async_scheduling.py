"""Async scheduling on the real SmolLM2 (CPU, float32): step N+1 is scheduled and launched
before step N's tokens are applied, and the tokens are exactly those of the synchronous
engine (the session `llm`, async scheduling off, the CPU default): greedy and seeded,
mixed lengths, max_tokens 1 and 2, EOS stops, aborts, late arrivals, preemption, prefix
hits, and the features that fall back to a synchronous step (structured output,
penalties, min_tokens, n > 1) or need none (stop strings, logprobs). The autouse fixture
checks after each test that no request, block or launched step is left behind.
"""

from __future__ import annotations

import asyncio

import pytest
from sampling import greedy

from ember import EngineConfig, SamplingParams, StructuredOutputsParams
from ember.engine.async_engine import AsyncEngine
from ember.request import Request

pytestmark = pytest.mark.slow

FRANCE = "The capital of France is"
PROMPTS = [
    "Hi",
    FRANCE,
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and his",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. In plants, photosynthesis generally involves the green pigment",
    "1, 2, 3, 4,",
]
# ~40-token prompts: six of them overflow a 12-block pool as they grow (see tiny pools below)
FORTY = [
    "Write a short story about a robot who learns to paint. The robot lives in a quiet city by the sea, and "
    "every single morning it stands on the pier and watches the old fishing boats leave the harbor while",
    "List five reasons why people enjoy hiking in the mountains during the long summer months, and explain "
    "for each one of them why it matters so much to beginners who have never been on a trail",
    "In mathematics, a prime number is a natural number greater than one that has no positive divisors other "
    "than one and itself. The first few prime numbers, in increasing order, are two, three, five,",
    "The recipe for a simple tomato soup needs ripe tomatoes, an onion, two cloves of garlic, olive oil, salt, "
    "pepper and a little fresh basil. First, peel and finely chop the onion and",
    "Dear hiring manager, I am writing to apply for the position of junior software engineer at your company. "
    "During my four years of studies at the university I built several projects in Python, including",
    "The ocean covers about seventy percent of the surface of the Earth and holds most of its water. Scientists "
    "usually divide it into five large basins: the Pacific, the Atlantic, the Indian, the",
]


def seeded(max_tokens: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def async_llm(extra_llm):
    return extra_llm(async_scheduling=True)


@pytest.fixture(scope="module")
def tiny_async(extra_llm):
    return extra_llm(num_kv_blocks=12, block_size=16, async_scheduling=True)


def summary(outs) -> list:
    """What a caller sees of each output but the logprob values (see assert_same)."""
    def ranks(entries):
        return None if entries is None else [None if e is None else {t: lp.rank for t, lp in e.items()}
                                             for e in entries]

    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, ranks(c.logprobs))
             for c in o.outputs] + [ranks(o.prompt_logprobs)] for o in outs]


def logprob_values(outs) -> list[float]:
    return [lp.logprob for o in outs for entries in [o.prompt_logprobs or []] + [c.logprobs or [] for c in o.outputs]
            for e in entries if e is not None for lp in e.values()]


def assert_same(got, want) -> None:
    """Exactly the same tokens, text, stops and logprob ranks; logprobs within float noise
    (a step's batch can differ: a request that finished at step N still has a row in N+1)."""
    assert summary(got) == summary(want)
    assert logprob_values(got) == pytest.approx(logprob_values(want), abs=1e-5)


class Spy:
    """Counts launched steps, plans that ran short of blocks, and, at each schedule, the
    pending tokens of the running requests; keeps each request launched with its input id
    pending (gathered on the device) with its output length then."""

    def __init__(self, llm, monkeypatch) -> None:
        core = llm.engine
        self.launches, self.pending, self.short, self.gathered = 0, [], 0, []
        launch, schedule = core.runner.launch, core.scheduler.schedule

        def spy_launch(plan, *args):
            self.launches += 1
            self.gathered += [(c.request, len(c.request.output_token_ids), c.request.num_samples_to_draw)
                              for c in plan.chunks if c.request.num_pending_tokens]
            return launch(plan, *args)

        def spy_schedule():
            self.pending.append(sorted({r.num_pending_tokens for r in core.scheduler.running}))
            plan = schedule()
            self.short += plan.short_of_blocks
            return plan

        monkeypatch.setattr(core.runner, "launch", spy_launch)
        monkeypatch.setattr(core.scheduler, "schedule", spy_schedule)


def test_on_only_when_asked_on_the_cpu(llm, async_llm):
    assert llm.config.async_scheduling is False and llm.engine.max_in_flight == 0
    assert async_llm.config.async_scheduling is True and async_llm.engine.max_in_flight == 1


def test_a_decode_step_is_launched_while_the_previous_one_is_in_flight(async_llm, llm):
    """Each step() launches the next step, then applies the previous one's tokens: the
    running requests' last tokens are pending while the next step is scheduled."""
    tok = llm.get_tokenizer()
    core = async_llm.engine
    reqs = [Request(f"overlap-{i}", tok.encode(p), greedy(6, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    for r in reqs:
        core.add_request(r)
    assert core.step() == []  # the prefill is launched, nothing is collected yet
    assert len(core.in_flight) == 1 and [r.num_pending_tokens for r in reqs] == [1, 1, 1]
    for n in range(1, 6):
        outs = core.step()  # launches decode n (its input ids gathered on the device), collects step n
        assert [o.request_id for o in outs] == [r.request_id for r in reqs] and all(len(o.new_token_ids) == 1 for o in outs)
        assert [len(r.output_token_ids) for r in reqs] == [n] * 3
        assert len(core.in_flight) == 1 and [r.num_pending_tokens for r in reqs] == [1, 1, 1]
    outs = core.step()  # max_tokens is reached with the pending token: nothing more is launched
    assert all(o.finished for o in outs) and not core.in_flight and not core.has_unfinished_requests()
    want = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], greedy(6, ignore_eos=True))
    assert [r.output_token_ids for r in reqs] == [o.outputs[0].token_ids for o in want]


def test_mixed_lengths_greedy_and_seeded_equal_sync(llm, async_llm, monkeypatch):
    prompts = PROMPTS + FORTY[:2]
    params = [greedy(1), greedy(40), seeded(2, 11), seeded(7, 12), greedy(16), seeded(20, 13), greedy(2),
              SamplingParams(temperature=1.0, top_k=20, seed=15, max_tokens=13)]
    want = llm.generate(prompts, params)
    spy = Spy(async_llm, monkeypatch)
    got = async_llm.generate(prompts, params)
    assert_same(got, want)
    assert "stop" in {o.outputs[0].finish_reason for o in want}  # an EOS stop is among them
    assert [len(o.outputs[0].token_ids) for o in want][:3:2] == [1, 2]
    assert any(p == [1] for p in spy.pending)  # steps were scheduled with every running token pending


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_max_tokens_1_and_2_launch_no_extra_step(llm, async_llm, monkeypatch, max_tokens):
    params = [greedy(max_tokens), seeded(max_tokens, 5)] * 3
    want = llm.generate(PROMPTS, params)
    spy = Spy(async_llm, monkeypatch)
    got = async_llm.generate(PROMPTS, params)
    assert_same(got, want)
    assert spy.launches == max_tokens


def test_an_eos_stop_drops_the_token_of_the_step_launched_after_it(llm, async_llm, monkeypatch):
    want = llm.generate(FRANCE, greedy(60))[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 60
    spy = Spy(async_llm, monkeypatch)
    got = async_llm.generate(FRANCE, greedy(60))[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert spy.launches == len(want.token_ids) + 1  # the step after the EOS ran; its token was dropped


def drive(llm, arrivals: dict[int, list[Request]], aborts: dict[int, list[str]] | None = None) -> None:
    """Step the core to the end; before step call k add arrivals[k] and abort aborts[k]."""
    core, k = llm.engine, 0
    while k <= max(arrivals) or core.has_unfinished_requests():
        for r in arrivals.get(k, []):
            core.add_request(r)
        for rid in (aborts or {}).get(k, []):
            core.abort_request(rid)
        core.step()
        k += 1


def late_arrivals(tok) -> dict[int, list[Request]]:
    ids = [tok.encode(p) for p in PROMPTS + FORTY[:2]]
    return {0: [Request("a", ids[1], greedy(20)), Request("b", ids[3], seeded(20, 1, ignore_eos=True))],
            3: [Request("c", ids[0], seeded(12, 2)), Request("d", ids[6], greedy(15, ignore_eos=True))],
            5: [Request("e", ids[4], greedy(1))],
            8: [Request("f", ids[7], seeded(9, 3)), Request("g", ids[2], greedy(2))]}


def test_requests_arriving_while_others_decode_equal_sync(llm, async_llm):
    tok = llm.get_tokenizer()
    sync_reqs, async_reqs = late_arrivals(tok), late_arrivals(tok)
    drive(llm, sync_reqs)
    drive(async_llm, async_reqs)
    for k in sync_reqs:
        for s, a in zip(sync_reqs[k], async_reqs[k]):
            assert (a.request_id, a.output_token_ids, a.finish_reason) == (s.request_id, s.output_token_ids,
                                                                           s.finish_reason)


def abort_requests(tok) -> list[Request]:
    return [Request(f"ab-{i}", tok.encode(p), greedy(16, ignore_eos=True) if i % 2 else seeded(16, i, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]


def test_aborts_mid_run_equal_sync(llm, async_llm):
    """Aborted at the same step calls, a request has one token less with async scheduling
    (the token in flight is dropped); the others' tokens are those of the synchronous run."""
    tok = llm.get_tokenizer()
    sync_reqs, async_reqs = abort_requests(tok), abort_requests(tok)
    aborts = {3: ["ab-1"], 4: ["ab-4"], 6: ["ab-0"]}
    drive(llm, {0: sync_reqs}, aborts)
    drive(async_llm, {0: async_reqs}, aborts)
    assert [len(r.output_token_ids) for r in sync_reqs] == [6, 3, 16, 16, 4, 16]
    for s, a in zip(sync_reqs, async_reqs):
        if s.finish_reason == "abort":
            assert a.finish_reason == "abort" and a.output_token_ids == s.output_token_ids[:-1]
        else:
            assert (a.output_token_ids, a.finish_reason) == (s.output_token_ids, "length")


def test_an_aborted_request_gives_its_blocks_back_once_the_step_in_flight_is_collected(llm, async_llm):
    core, pool = async_llm.engine, async_llm.engine.block_pool
    reqs = abort_requests(llm.get_tokenizer())
    for r in reqs:
        core.add_request(r)
    for _ in range(3):
        core.step()
    gone = reqs[5]
    held = list(gone.block_ids)
    assert held and gone.num_steps_in_flight == 1
    core.abort_request(gone.request_id)
    assert gone.finish_reason == "abort" and gone.block_ids == []
    assert all(pool.ref_counts[b] == 1 for b in held)  # the launched step still writes its KV
    core.step()
    assert all(pool.ref_counts[b] == 0 for b in held)
    assert len(gone.output_token_ids) == 2
    for r in reqs:
        core.abort_request(r.request_id)
    assert core.finish_in_flight() == []


def test_preemption_in_a_tiny_pool_equals_sync(llm, tiny_async, monkeypatch):
    """12 blocks of 16 tokens: six ~40-token prompts growing to 4 blocks each must preempt.
    Preempted and recomputed, every request gives the tokens of the big synchronous pool
    (batch invariance: tests/engine/test_batch_invariance.py)."""
    ids = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in FORTY]
    params = [greedy(24, ignore_eos=True), seeded(24, 21, ignore_eos=True)] * 3
    want = llm.generate(ids, params)
    before = tiny_async.engine.scheduler.num_preemptions
    spy = Spy(tiny_async, monkeypatch)
    got = tiny_async.generate(ids, params)
    assert tiny_async.engine.scheduler.num_preemptions > before
    assert spy.short > 0  # steps ran short of blocks while another was in flight, then fell back
    assert_same(got, want)


def test_prefix_cache_hits_equal_sync(llm, async_llm):
    system = ("You are a careful assistant for a small library. You answer questions about opening hours, "
              "borrowing rules and the reading room in two short sentences. ") * 3
    prompts = [system + q for q in ("When do you open on Monday?", "How many books can I borrow?",
                                    "Is there wifi in the reading room?")]
    params = [greedy(8), seeded(8, 4), greedy(8, ignore_eos=True)]
    for _ in range(2):  # the second round hits the first one's blocks
        hits = async_llm.engine.scheduler.prefix_cache_hits
        want, got = llm.generate(prompts, params), async_llm.generate(prompts, params)
        assert_same(got, want)
    assert async_llm.engine.scheduler.prefix_cache_hits - hits >= 3 * (len(got[0].prompt_token_ids) // 16 - 1) * 16


JSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}

FALLBACKS = {  # each batch runs next to free greedy and seeded requests
    "structured output": [greedy(12, structured_outputs=StructuredOutputsParams(json=JSON)),
                          seeded(8, 8, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))],
    "penalties": [greedy(12, repetition_penalty=1.3), seeded(12, 9, presence_penalty=1.0),
                  greedy(12, frequency_penalty=0.8)],
    "min_tokens": [greedy(12, min_tokens=8), seeded(12, 10, min_tokens=5, stop_token_ids=[13])],
    "n > 1": [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8), SamplingParams(n=3, temperature=0,
                                                                                           max_tokens=6)],
}
NO_FALLBACK = {  # these take the async path
    "stop strings": [greedy(16, stop=["answer"]), greedy(16, stop=["\n"]), seeded(16, 6, stop=[" the", "."])],
    "logprobs": [greedy(8, logprobs=3), seeded(8, 7, logprobs=0), greedy(4, prompt_logprobs=2),
                 greedy(0, prompt_logprobs=1), seeded(0, 4, prompt_logprobs=0, logprobs=1)],  # 0: prompt scoring
}


@pytest.mark.parametrize("case", [*FALLBACKS, *NO_FALLBACK])
def test_features_with_async_scheduling_on_equal_sync(llm, async_llm, monkeypatch, case):
    special = {**FALLBACKS, **NO_FALLBACK}[case]
    params = special + [greedy(10), seeded(10, 30)]
    prompts = (PROMPTS[1:] * 2)[:len(params)]  # the capital of France first
    want = llm.generate(prompts, params)
    spy = Spy(async_llm, monkeypatch)
    got = async_llm.generate(prompts, params)
    assert_same(got, want)
    for req, num_output, draws in spy.gathered:  # no sampler row reading the output had a pending token
        p = req.sampling_params
        assert p.structured_outputs is None and num_output >= p.min_tokens and draws == 1
        assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    if case in NO_FALLBACK:  # these requests themselves took the async path
        assert any(r.sampling_params in special for r, _, _ in spy.gathered)
    if case == "structured output":
        assert got[0].outputs[0].text.startswith('{"name": "') and got[1].outputs[0].text in ("yes", "no", "maybe")
    if case == "stop strings":
        assert got[0].outputs[0].stop_reason == "answer" and got[0].outputs[0].text == " Paris.\n\nThe "


def test_an_error_or_a_stream_closed_early_leaves_nothing_behind(llm, async_llm, monkeypatch, fail_launch):
    want = llm.generate(FRANCE, greedy(5))[0].outputs[0].token_ids
    gen = async_llm.stream(FRANCE, greedy(12, ignore_eos=True))
    assert next(gen).outputs[0].token_ids == want[:1]
    assert async_llm.engine.in_flight  # a step is in flight when the stream is closed
    gen.close()
    async_llm.check_idle()

    fail_launch(async_llm, at_call=3)
    with pytest.raises(RuntimeError, match="boom"):
        async_llm.generate([FRANCE, "Water boils at"], greedy(5))
    async_llm.check_idle()
    monkeypatch.undo()
    assert async_llm.generate(FRANCE, greedy(5))[0].outputs[0].token_ids == want


def test_profile_steps_counts_cpu_phases_and_the_wait(async_llm, monkeypatch):
    runner = async_llm.engine.runner
    runner.step_times.clear()
    monkeypatch.setattr(runner, "profile_steps", True)
    spy = Spy(async_llm, monkeypatch)
    async_llm.generate(PROMPTS, greedy(8, ignore_eos=True))
    times = dict(runner.step_times)
    runner.step_times.clear()
    assert set(times) == {"schedule", "prepare", "forward", "sample", "wait", "update", "steps"}
    assert times["steps"] == spy.launches == 8


def test_the_async_engine_front_with_async_scheduling(gguf_path, llm):
    params = [greedy(10), greedy(10, stop=["\n"]), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8),
              greedy(6, logprobs=2)]
    prompts = PROMPTS[1:5]
    want = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    engine = AsyncEngine(EngineConfig(model=str(gguf_path), dtype="float32", quantization="none", async_scheduling=True))
    try:
        async def run():
            long = engine.add_request(FRANCE, greedy(2000, ignore_eos=True))
            outs = await asyncio.gather(*[_last(engine.add_request(p, sp)) for p, sp in zip(prompts, params)])
            async for out in long:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            long.abort()
            return outs

        got = asyncio.run(run())  # a batch other than the references': logprobs may differ in float noise
        assert summary(got) == summary(want)
    finally:
        engine.stop()
    engine.core.check_idle()


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out
