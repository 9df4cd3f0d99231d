"""Beam search (`LLM.beam_search`, BeamSearchParams) against transformers' `generate(num_beams=k,
do_sample=False)` on a tiny random Llama in float32 whose small vocabulary makes EOS likely: the
same sequences, in the same order, with the same scores, for k = 1..8, length penalties and
every early_stopping mode."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

EOS = 2
PROMPTS = [[5, 17, 33, 3, 40, 41, 8], [7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("beams")
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # EOS often among the best tokens: hypotheses end along the way
        model.lm_head.weight[EOS] *= 6
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def llm(tiny, live_engines):
    engine = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256)
    live_engines.append(engine)
    yield engine
    live_engines.remove(engine)


def hf_beams(hf, prompt: list[int], k: int, max_tokens: int, length_penalty: float, early_stopping, ignore_eos: bool):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=max_tokens,
                      length_penalty=length_penalty, early_stopping=early_stopping, pad_token_id=0,
                      eos_token_id=None if ignore_eos else EOS, return_dict_in_generate=True, output_scores=True)
    scores = out.sequences_scores.tolist() if k > 1 else [None]
    return [(row.tolist(), score) for row, score in zip(out.sequences, scores)]


def strip(row: list[int], prompt_len: int, ignore_eos: bool) -> list[int]:
    """A transformers row without the padding after its EOS (pad 0; EOS ends a hypothesis)."""
    gen = row[prompt_len:]
    if EOS in gen and not ignore_eos:
        gen = gen[:gen.index(EOS) + 1]
    return row[:prompt_len] + gen


@pytest.mark.parametrize("k, length_penalty, early_stopping, ignore_eos", [
    (1, 1.0, False, False), (2, 1.0, False, False), (3, 0.0, True, False), (4, 1.0, False, False),
    (4, 2.0, "never", False), (5, -1.0, True, False), (8, 1.0, False, False), (4, 1.0, False, True)])
def test_beams_equal_transformers(llm, tiny, k, length_penalty, early_stopping, ignore_eos):
    hf = tiny[1]
    params = BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping, ignore_eos=ignore_eos)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    stopped = 0
    for prompt, out in zip(PROMPTS, outs):
        want = hf_beams(hf, prompt, k, 12, length_penalty, early_stopping, ignore_eos)
        got = [(s.tokens, s.score) for s in out.sequences]
        assert [s for s, _ in got] == [strip(row, len(prompt), ignore_eos) for row, _ in want], (prompt, k)
        if k > 1:
            torch.testing.assert_close(torch.tensor([s for _, s in got]), torch.tensor([s for _, s in want]),
                                       rtol=1e-5, atol=1e-5)
        stopped += sum(s.finish_reason == "stop" for s in out.sequences)
        for s in out.sequences:  # the summed log-probabilities, by the score's own formula
            n = len(s.tokens) - len(prompt)
            assert s.score == pytest.approx(s.cum_logprob / n ** length_penalty, rel=1e-5, abs=1e-6)
    if not ignore_eos and k > 1:
        assert stopped > 0  # some hypotheses ended with EOS
    llm.engine.check_idle()


def test_bad_beam_params_are_refused():
    with pytest.raises(ValueError, match="beam_width must be an integer in 1..10"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="leave temperature 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping must be"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def beam_request(llm, request_id: str, prompt: list[int], params: BeamSearchParams):
    return llm.inputs.make_request(request_id, {"prompt_token_ids": prompt}, params.step_params(), beam=params)


def run_core(core, requests) -> dict[str, list]:
    """Step an engine core until these requests are done: every output, by request id."""
    for req in requests:
        core.add_request(req)
    got: dict[str, list] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def test_beams_in_a_small_pool_wait_for_each_other(tiny):
    """Six searches of 4 beams in a pool that holds about one: beams are preempted, a beam whose
    token is in waits (held) for its group's others, and held beams make room for the waiting
    ones when nothing else can run; the sequences and scores stay transformers'."""
    engine = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=16, max_model_len=256)
    params = BeamSearchParams(beam_width=4, max_tokens=12)
    prompts = PROMPTS + [list(range(9, 27)), [20, 21, 22, 23, 24, 25, 26, 27, 28], [44, 45]]
    outs = engine.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        want = hf_beams(tiny[1], prompt, 4, 12, 1.0, False, False)
        assert [s.tokens for s in out.sequences] == [strip(row, len(prompt), False) for row, _ in want]
        torch.testing.assert_close(torch.tensor([s.score for s in out.sequences]),
                                   torch.tensor([s for _, s in want]), rtol=1e-5, atol=1e-5)
    assert engine.engine.scheduler.num_preemptions > 0
    assert engine.engine.beams.num_unblocked > 0
    assert not engine.engine.beams.groups
    engine.engine.check_idle()


def test_a_beam_search_runs_beside_sampled_requests(llm):
    """A search's beams decode in the same steps as plain requests: each gets what it gets alone."""
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=10)
    alone_beams = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    alone_text = llm.generate([{"prompt_token_ids": PROMPTS[2]}], sampling)[0].outputs[0].token_ids
    core = llm.engine
    got = run_core(core, [beam_request(llm, "beams", PROMPTS[0], params),
                          llm.inputs.make_request("plain", {"prompt_token_ids": PROMPTS[2]}, sampling)])
    assert [t for o in got["plain"] for t in o.new_token_ids] == alone_text
    finals = [got["beams"][-1]] + [got[f"beams#{i}"][-1] for i in (1, 2)]
    assert [PROMPTS[0] + o.new_token_ids for o in finals] == [s.tokens for s in alone_beams.sequences]
    assert [o.cumulative_logprob for o in finals] == [s.cum_logprob for s in alone_beams.sequences]
    assert len(got["beams"]) == 1  # the search's outputs come at its end only
    core.check_idle()


def test_beams_share_blocks_and_leave_none(llm):
    """Beams that continue one another share their full blocks (fewer in use than k copies of
    the longest); aborting a search, or failing one of its beams, frees every block and gives
    one output for the search."""
    core = llm.engine
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    core.add_request(beam_request(llm, "a", PROMPTS[2], params))
    peak, beams = 0, 0
    for _ in range(8):
        core.step()
        peak = max(peak, core.block_pool.num_in_use)
        beams = max(beams, len(core.beams.groups["a"].beams))
    assert beams == 4
    longest = core.scheduler.blocks_for(len(PROMPTS[2]) + 8)
    assert peak < 4 * longest, (peak, longest)
    core.abort_request("a")
    assert not core.beams.groups
    core.check_idle()

    core.add_request(beam_request(llm, "b", PROMPTS[0], params))
    for _ in range(4):
        core.step()
    member = core.beams.groups["b"].beams[-1].request_id
    assert member.startswith("b#b")  # a fork's id
    core.fail_request(member, "a row failed")
    outs = core.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.error) for o in outs] == [
        ("b", True, "error", "a row failed")]
    assert not core.beams.groups
    core.check_idle()


def test_a_beam_whose_row_fails_fails_its_search_alone(llm, monkeypatch):
    """A beam's sampling row that fails while a step runs: the search ends with one error output
    (its other beams stepped in that step are passed over), another search and a plain request
    beside it go on."""
    core, runner = llm.engine, llm.engine.runner
    generator = runner._generator

    def failing(req, index):
        if req.request_id == "d#b2":
            raise RuntimeError("injected")
        return generator(req, index)

    monkeypatch.setattr(runner, "_generator", failing)
    params = BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate([{"prompt_token_ids": PROMPTS[1]}], plain)[0].outputs[0].token_ids
    beams = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    got = run_core(core, [beam_request(llm, "d", PROMPTS[2], params), beam_request(llm, "f", PROMPTS[0], params),
                          llm.inputs.make_request("e", {"prompt_token_ids": PROMPTS[1]}, plain)])
    assert [(o.finished, o.finish_reason, o.error) for o in got["d"]] == [
        (True, "error", "its sampling parameters could not be applied (RuntimeError)")]
    assert [t for o in got["e"] for t in o.new_token_ids] == want
    finals = [got["f"][-1]] + [got[f"f#{i}"][-1] for i in (1, 2, 3)]
    assert [PROMPTS[0] + o.new_token_ids for o in finals] == [s.tokens for s in beams.sequences]
    assert not core.beams.groups
    core.check_idle()


def test_beam_searches_the_engine_cannot_hold_are_refused(tiny, llm):
    small = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=8, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="beam_width 5 is more than the engine's 4 sequences"):
        small.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="4 beams of 26 tokens need 16 KV blocks; the engine has 8"):
        small.beam_search([{"prompt_token_ids": list(range(3, 17))}], BeamSearchParams(beam_width=4, max_tokens=12))
    with pytest.raises(ValueError, match="are more than max_model_len 64: lower max_tokens"):
        small.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=2, max_tokens=63))
    small.engine.check_idle()
    drafting = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=64,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="beam search with speculative decoding is not supported"):
        drafting.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=2, max_tokens=4))


def test_beams_under_async_scheduling(tiny, llm):
    """With async scheduling (CUDA's default) a step of beams is still collected before the next
    schedule (the search needs its log-probabilities): the same sequences and scores."""
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    engine = LLM(str(tiny[0]), dtype="float32", block_size=8, num_kv_blocks=256, max_model_len=256,
                 async_scheduling=True)
    got = engine.beam_search(prompts, params)
    want = llm.beam_search(prompts, params)
    assert [[(s.tokens, s.score, s.cum_logprob) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.score, s.cum_logprob) for s in o.sequences] for o in want]
    engine.engine.check_idle()
