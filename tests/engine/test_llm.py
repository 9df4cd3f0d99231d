"""The offline API (`LLM.generate / chat / stream`), vLLM's shape, on the real SmolLM2 model.

Expected token ids were recorded from ember's own greedy output (float32, CPU) and checked
by hand for sense (" Paris.", " 5, 6, 7, 8,"); the end-to-end tests in tests/models check the
same model token-for-token against HF transformers.

After every test the engines hold no KV block and no request (autouse `engines_idle`).
"""

from __future__ import annotations

import pytest
import torch
from sampling import greedy

from ember import LLM, EngineConfig, SamplingParams
from ember.outputs import RequestOutput

EOS = 2  # <|im_end|>
VOCAB = 49152
CONTEXT = 8192  # SmolLM2's context length (GGUF llama.context_length)

FRANCE = "The capital of France is"
FRANCE_IDS = [504, 3575, 282, 4649, 314]
# greedy, 12 tokens: " Paris.\n\nThe answer is: 201"
FRANCE_OUT = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]
FRANCE_TEXT = " Paris.\n\nThe answer is: 201"

# six different prompts and their greedy first 8 tokens (recorded in one batch)
BATCH = {
    "The capital of France is": [7042, 30, 198, 198, 504, 2988, 314, 42],
    "Once upon a time": [28, 260, 2240, 282, 23324, 27108, 436, 253],
    "def fibonacci(n):": [472, 585, 304, 1758, 216, 32, 42, 448],
    "1, 2, 3, 4,": [216, 37, 28, 216, 38, 28, 216, 39],
    "The quick brown fox": [351, 253, 2365, 6354, 7012, 30, 198, 198],
    "Water boils at": [216, 33, 32, 32, 4742, 51, 28, 527],
}

YES_NO = [{"role": "user", "content": "Reply with one word: yes or no?"}]
YES_NO_OUT = [10539, 30, EOS]  # "Yes." <|im_end|>
TWO_PLUS_TWO = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
TWO_PLUS_TWO_OUT = [34, 1232, 216, 34, 446, 216, 36, EOS]  # "2 + 2 = 4" <|im_end|>


# ---- engines and the idle check ----------------------------------------------------------

@pytest.fixture(scope="module")
def short_llm(extra_llm):
    """max_model_len=64: prompts of 64+ tokens are refused."""
    return extra_llm(max_model_len=64)


@pytest.fixture(scope="module")
def tiny_pool_llm(extra_llm):
    """A KV pool of 4 blocks of 16 tokens: 64 tokens in all, whatever max_model_len says."""
    return extra_llm(num_kv_blocks=4, block_size=16)


def ids_of(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- prompt forms and the shape of RequestOutput -----------------------------------------

def test_one_string_gives_one_output(llm):
    outs = llm.generate(FRANCE, greedy(5))
    assert len(outs) == 1
    out = outs[0]
    assert isinstance(out, RequestOutput)
    assert out.prompt == FRANCE
    assert out.prompt_token_ids == FRANCE_IDS == llm.get_tokenizer().encode(FRANCE)
    assert out.finished is True
    assert len(out.outputs) == 1
    c = out.outputs[0]
    assert c.index == 0
    assert c.token_ids == FRANCE_OUT[:5]
    assert c.text == " Paris.\n\nThe"
    assert c.finish_reason == "length"
    assert c.stop_reason is None


def test_every_prompt_form_in_one_batch_in_input_order(llm):
    tok = llm.get_tokenizer()
    fib_ids = tok.encode("def fibonacci(n):")
    prompts = [
        FRANCE,
        {"prompt_token_ids": fib_ids},
        "1, 2, 3, 4,",
        {"prompt_token_ids": FRANCE_IDS},
        {"prompt": "Water boils at"},
    ]
    outs = llm.generate(prompts, greedy(3))
    assert [o.prompt for o in outs] == [FRANCE, None, "1, 2, 3, 4,", None, "Water boils at"]
    assert [o.prompt_token_ids for o in outs] == [
        FRANCE_IDS, fib_ids, tok.encode("1, 2, 3, 4,"), FRANCE_IDS, [12615, 36411, 418]]
    assert fib_ids == [1604, 3987, 46477, 24, 94, 727]
    assert ids_of(outs) == [BATCH[FRANCE][:3], BATCH["def fibonacci(n):"][:3], BATCH["1, 2, 3, 4,"][:3],
                            BATCH[FRANCE][:3], BATCH["Water boils at"][:3]]
    assert [o.outputs[0].text for o in outs] == [" Paris.\n", "\n    if n", " 5,", " Paris.\n", " 10"]
    assert len({o.request_id for o in outs}) == 5
    assert all(isinstance(o.request_id, str) for o in outs)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_list_of_token_id_prompts(llm):
    outs = llm.generate([{"prompt_token_ids": FRANCE_IDS}, {"prompt_token_ids": [12615, 36411, 418]}], greedy(4))
    assert [o.prompt for o in outs] == [None, None]
    assert ids_of(outs) == [FRANCE_OUT[:4], BATCH["Water boils at"][:4]]
    # a token-id prompt still gets text: the model has a tokenizer
    assert [o.outputs[0].text for o in outs] == [" Paris.\n\n", " 100"]


def test_request_ids_are_distinct_across_calls(llm):
    a = llm.generate([FRANCE, FRANCE], greedy(1))
    b = llm.generate(FRANCE, greedy(1))
    ids = [o.request_id for o in a + b]
    assert len(set(ids)) == 3


def test_text_and_token_ids_give_the_same_output(llm):
    as_text = llm.generate(FRANCE, greedy(6))[0]
    as_ids = llm.generate({"prompt_token_ids": FRANCE_IDS}, greedy(6))[0]
    assert as_text.outputs[0].token_ids == as_ids.outputs[0].token_ids == FRANCE_OUT[:6]
    assert as_text.outputs[0].text == as_ids.outputs[0].text == " Paris.\n\nThe answer"


def test_greedy_output_does_not_depend_on_the_batch(llm):
    batch = llm.generate(list(BATCH), greedy(8))
    assert ids_of(batch) == list(BATCH.values())
    for prompt in ("def fibonacci(n):", "1, 2, 3, 4,"):
        alone = llm.generate(prompt, greedy(8))[0]
        assert alone.outputs[0].token_ids == BATCH[prompt]


def test_no_prompts_no_outputs(llm):
    assert llm.generate([], greedy(1)) == []


def test_an_error_inside_the_loop_leaves_nothing_behind(llm, monkeypatch, fail_launch):
    """A failure mid-generation (here: the second forward pass) aborts the call's requests,
    frees their blocks, and the engine serves the next call."""
    fail_launch(llm, at_call=2)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([FRANCE, "Water boils at"], greedy(5))
    llm.check_idle()
    monkeypatch.undo()
    assert llm.generate(FRANCE, greedy(3))[0].outputs[0].token_ids == FRANCE_OUT[:3]


# ---- finishing: length and EOS -------------------------------------------------------------

def test_max_tokens_gives_exactly_that_many(llm):
    out = llm.generate("1, 2, 3, 4,", greedy(5))[0].outputs[0]
    assert out.token_ids == [216, 37, 28, 216, 38]
    assert out.text == " 5, 6"
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def test_eos_ends_with_stop_and_keeps_the_eos_id_but_not_its_text(llm):
    """As vLLM: token_ids end with EOS, the text does not show it, stop_reason is None."""
    out = llm.chat(YES_NO, greedy(16))[0].outputs[0]
    assert out.token_ids == YES_NO_OUT
    assert out.token_ids[-1] == EOS
    assert out.text == "Yes."
    assert out.finish_reason == "stop"
    assert out.stop_reason is None


def test_ignore_eos_runs_past_eos(llm):
    out = llm.chat(YES_NO, greedy(4, ignore_eos=True))[0].outputs[0]
    assert out.token_ids[:3] == YES_NO_OUT
    assert len(out.token_ids) == 4
    assert out.finish_reason == "length"


def test_min_tokens_keeps_eos_from_being_sampled(llm):
    """As vLLM: EOS (and stop_token_ids) cannot be sampled before min_tokens tokens."""
    out = llm.chat(YES_NO, greedy(6, min_tokens=4))[0].outputs[0]
    assert out.token_ids == [10539, 30, 339, 416, 15482, 351]
    assert out.text == "Yes. I can reply with"
    assert out.finish_reason == "length"


def test_min_tokens_keeps_stop_token_ids_from_being_sampled(llm):
    out = llm.generate(FRANCE, greedy(6, min_tokens=4, stop_token_ids=[198]))[0].outputs[0]
    assert out.token_ids == [7042, 30, 378, 3575, 282, 4649]
    assert out.finish_reason == "length"


# ---- sampling params: one or one per prompt ------------------------------------------------

def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate([FRANCE, "1, 2, 3, 4,"], [greedy(2), greedy(4)])
    assert ids_of(outs) == [FRANCE_OUT[:2], BATCH["1, 2, 3, 4,"][:4]]


def test_no_sampling_params_means_vllm_defaults(llm):
    """vLLM's defaults: temperature 1.0 (random), max_tokens 16."""
    out = llm.generate(FRANCE)[0].outputs[0]
    assert len(out.token_ids) == 16 or out.finish_reason == "stop"
    assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16


@pytest.mark.parametrize("n", [0, 1, 3])
def test_sampling_params_list_of_the_wrong_length(llm, n):
    with pytest.raises(ValueError, match=rf"got {n} SamplingParams for 2 prompts: pass one, or one per prompt"):
        llm.generate([FRANCE, "Water boils at"], [greedy(1)] * n)


# ---- chat ----------------------------------------------------------------------------------

def test_chat_one_conversation_matches_hf_chat_template(llm, hf_tokenizer):
    out = llm.chat(YES_NO, greedy(16))
    assert len(out) == 1
    expected = hf_tokenizer.apply_chat_template(YES_NO, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert out[0].prompt_token_ids == expected
    assert expected[-4:] == [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
    assert out[0].prompt == llm.get_tokenizer().apply_chat_template(YES_NO, add_generation_prompt=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\n")
    assert out[0].outputs[0].token_ids == YES_NO_OUT


def test_chat_list_of_conversations(llm, hf_tokenizer):
    multi_turn = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Reply with one word: yes or no?"},
    ]
    outs = llm.chat([YES_NO, TWO_PLUS_TWO, multi_turn], greedy(10))
    assert len(outs) == 3
    for conv, out in zip([YES_NO, TWO_PLUS_TWO, multi_turn], outs):
        expected = hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert out.prompt_token_ids == expected
    assert outs[0].outputs[0].token_ids == YES_NO_OUT
    assert outs[1].outputs[0].token_ids == TWO_PLUS_TWO_OUT
    assert outs[1].outputs[0].text == "2 + 2 = 4"
    assert len({o.request_id for o in outs}) == 3


def test_chat_with_no_messages(llm):
    with pytest.raises(ValueError, match="messages is empty"):
        llm.chat([])


# ---- stop strings and stop token ids -------------------------------------------------------

def test_greedy_reference_for_stops(llm):
    out = llm.generate(FRANCE, greedy(12))[0].outputs[0]
    assert out.token_ids == FRANCE_OUT
    assert out.text == FRANCE_TEXT


def test_stop_string_cuts_the_text_before_it(llm):
    out = llm.generate(FRANCE, greedy(12, stop=["answer"]))[0].outputs[0]
    assert out.text == " Paris.\n\nThe "
    assert out.token_ids == FRANCE_OUT[:6]  # the token that completed the stop string is kept
    assert out.finish_reason == "stop"
    assert out.stop_reason == "answer"


def test_stop_string_included_on_request(llm):
    out = llm.generate(FRANCE, greedy(12, stop=["answer"], include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == " Paris.\n\nThe answer"
    assert out.token_ids == FRANCE_OUT[:6]
    assert out.finish_reason == "stop"
    assert out.stop_reason == "answer"


def test_stop_string_spanning_two_tokens(llm):
    out = llm.generate(FRANCE, greedy(12, stop=["\n\n"]))[0].outputs[0]
    assert out.text == " Paris."
    assert out.token_ids == [7042, 30, 198, 198]
    assert out.stop_reason == "\n\n"


def test_stop_string_inside_one_token(llm):
    """' Paris' holds 'is': the text stops mid-token."""
    out = llm.generate(FRANCE, greedy(12, stop=["is"]))[0].outputs[0]
    assert out.text == " Par"
    assert out.token_ids == [7042]
    assert out.stop_reason == "is"


def test_first_matching_stop_string_wins(llm):
    out = llm.generate(FRANCE, greedy(12, stop=["201", "The"]))[0].outputs[0]
    assert out.text == " Paris.\n\n"
    assert out.stop_reason == "The"
    assert out.token_ids == FRANCE_OUT[:5]


def test_stop_string_that_never_appears(llm):
    out = llm.generate(FRANCE, greedy(6, stop=["London"]))[0].outputs[0]
    assert out.text == " Paris.\n\nThe answer"
    assert out.finish_reason == "length"
    assert out.stop_reason is None


def test_stop_string_completed_by_the_last_allowed_token(llm):
    out = llm.generate(FRANCE, greedy(6, stop=["answer"]))[0].outputs[0]
    assert out.token_ids == FRANCE_OUT[:6]
    assert (out.text, out.finish_reason, out.stop_reason) == (" Paris.\n\nThe ", "stop", "answer")


def test_stop_token_id_stops_right_after_it(llm):
    out = llm.generate(FRANCE, greedy(12, stop_token_ids=[198]))[0].outputs[0]
    assert out.token_ids == [7042, 30, 198]  # the stop token is kept in token_ids
    assert out.finish_reason == "stop"
    assert out.stop_reason == 198


def test_stop_token_id_other_than_first_occurrence(llm):
    out = llm.generate(FRANCE, greedy(12, stop_token_ids=[314, 2988]))[0].outputs[0]
    assert out.token_ids == FRANCE_OUT[:6]
    assert out.stop_reason == 2988


def test_stop_token_text_is_left_out_like_vllm(llm):
    out = llm.generate(FRANCE, greedy(12, stop_token_ids=[198]))[0].outputs[0]
    assert out.text == " Paris."


def test_eos_text_left_out_even_without_skipping_special_tokens(llm):
    out = llm.chat(YES_NO, greedy(8, skip_special_tokens=False))[0].outputs[0]
    assert out.token_ids == YES_NO_OUT
    assert out.text == "Yes."


# ---- seeded sampling ------------------------------------------------------------------------

SEEDED = {1: [7042, 30, 198, 504, 701], 2: [7042, 30, 1068, 1183, 28]}


def sampled(seed: int | None, max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    alone = llm.generate(FRANCE, sampled(1))[0].outputs[0].token_ids
    assert alone == SEEDED[1]
    outs = llm.generate(["Once upon a time", FRANCE, "Water boils at", FRANCE, FRANCE],
                        [sampled(None), sampled(1), greedy(3), sampled(2), sampled(1)])
    assert ids_of(outs)[1] == SEEDED[1]
    assert ids_of(outs)[4] == SEEDED[1]
    assert ids_of(outs)[3] == SEEDED[2]
    assert ids_of(outs)[2] == BATCH["Water boils at"][:3]


def test_different_seeds_different_tokens(llm):
    outs = llm.generate([FRANCE, FRANCE], [sampled(1), sampled(2)])
    assert ids_of(outs) == [SEEDED[1], SEEDED[2]]


# ---- streaming -----------------------------------------------------------------------------

def test_stream_grows_by_prefix_and_ends_like_generate(llm):
    params = greedy(6)
    steps = list(llm.stream(FRANCE, params))
    assert len(steps) == 6  # one output per generated token
    for prev, cur in zip(steps, steps[1:]):
        assert cur.outputs[0].text.startswith(prev.outputs[0].text)
        assert cur.outputs[0].token_ids[:-1] == prev.outputs[0].token_ids
    assert [s.finished for s in steps] == [False] * 5 + [True]
    assert [s.outputs[0].finish_reason for s in steps] == [None] * 5 + ["length"]
    assert len({s.request_id for s in steps}) == 1
    last, full = steps[-1].outputs[0], llm.generate(FRANCE, params)[0].outputs[0]
    assert (last.text, last.token_ids, last.finish_reason) == (full.text, full.token_ids, full.finish_reason)
    assert last.token_ids == FRANCE_OUT[:6]


def test_stream_with_a_stop_string_ends_at_it(llm):
    steps = list(llm.stream(FRANCE, greedy(12, stop=["answer"])))
    assert steps[-1].finished
    assert steps[-1].outputs[0].text == " Paris.\n\nThe "
    assert steps[-1].outputs[0].stop_reason == "answer"


def test_stream_closed_early_frees_the_request(llm):
    gen = llm.stream(FRANCE, greedy(12))
    first = next(gen)
    assert first.outputs[0].token_ids == FRANCE_OUT[:1]
    assert llm.engine.block_pool.num_free < llm.engine.block_pool.num_blocks  # it holds blocks now
    gen.close()  # the autouse check: nothing is left behind


# ---- bad input: refused at the boundary with a clear message -------------------------------

@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}], ids=["empty-text", "empty-ids"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="the prompt is empty: give at least one token"):
        llm.generate(prompt, greedy(1))


@pytest.mark.parametrize("bad", [VOCAB, -1, 10**9])
def test_token_id_out_of_range(llm, bad):
    with pytest.raises(ValueError, match=rf"integers in \[0, {VOCAB}\); got \[{bad}\]"):
        llm.generate({"prompt_token_ids": [504, bad, 3575]}, greedy(1))


def test_non_integer_token_id(llm):
    with pytest.raises(ValueError, match=r"integers in \[0, 49152\); got \[1.5\]"):
        llm.generate({"prompt_token_ids": [504, 1.5]}, greedy(1))


def test_a_bad_prompt_in_a_batch_refuses_the_whole_call(llm):
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([FRANCE, ""], greedy(1))
    # and the engine still serves
    assert llm.generate(FRANCE, greedy(2))[0].outputs[0].token_ids == FRANCE_OUT[:2]


def test_unknown_prompt_type(llm):
    with pytest.raises(ValueError, match=r"a prompt is a str or \{'prompt_token_ids': \[...\]\}; got int"):
        llm.generate([FRANCE, 42], greedy(1))


def test_prompt_longer_than_max_model_len(short_llm):
    ids = [504] * 100
    with pytest.raises(ValueError, match="the prompt has 100 tokens but max_model_len is 64"):
        short_llm.generate({"prompt_token_ids": ids}, greedy(1))


def test_prompt_of_exactly_max_model_len_leaves_no_room(short_llm):
    with pytest.raises(ValueError, match="the prompt has 64 tokens but max_model_len is 64, which leaves no room"):
        short_llm.generate({"prompt_token_ids": [504] * 64}, greedy(1))


def test_prompt_one_short_of_max_model_len_gets_one_token(short_llm):
    ids = (FRANCE_IDS * 13)[:63]
    out = short_llm.generate({"prompt_token_ids": ids}, greedy(10))[0].outputs[0]
    assert len(out.token_ids) == 1
    assert out.finish_reason == "length"


def test_output_stops_at_max_model_len(short_llm):
    out = short_llm.generate({"prompt_token_ids": FRANCE_IDS * 12}, SamplingParams(temperature=0, max_tokens=None))
    assert len(out[0].prompt_token_ids) == 60
    assert len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("max_tokens", -1), ("n", 0),
    ("min_p", 2), ("repetition_penalty", 0), ("min_tokens", -1),
])
def test_bad_sampling_params(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be .*; got {value!r}"):
        SamplingParams(**{field: value})


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(llm):
    """Prompt scoring (what evaluation harnesses ask for): the prompt's logprobs, no token,
    and no block held after; as the prompt logprobs of a request that generates."""
    want = llm.generate(FRANCE, greedy(1, prompt_logprobs=2))[0].prompt_logprobs
    params = [greedy(0, prompt_logprobs=2), greedy(0, prompt_logprobs=2, logprobs=3), greedy(3)]
    outs = llm.generate([FRANCE, FRANCE, "Hello"], params)
    for out in outs[:2]:
        c = out.outputs[0]
        assert (c.token_ids, c.text, c.finish_reason) == ([], "", "length")
        assert len(out.prompt_logprobs) == len(FRANCE_IDS) and out.prompt_logprobs[0] is None
        for got, ref in zip(out.prompt_logprobs[1:], want[1:]):
            assert list(got) == list(ref)
            assert [(lp.rank, lp.decoded_token) for lp in got.values()] == \
                [(lp.rank, lp.decoded_token) for lp in ref.values()]
            assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in ref.values()], abs=1e-5)
    assert outs[1].outputs[0].logprobs == []
    assert len(outs[2].outputs[0].token_ids) == 3  # the request next to them generates as ever
    llm.check_idle()


def test_max_tokens_0_takes_one_sample():
    with pytest.raises(ValueError, match=r"SamplingParams\.n must be 1 with max_tokens=0"):
        SamplingParams(n=2, max_tokens=0)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"SamplingParams\.min_tokens must be <= max_tokens \(4\); got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_empty_stop_string():
    with pytest.raises(ValueError, match=r"SamplingParams\.stop must be a string or a list of non-empty strings"):
        SamplingParams(stop=[""])


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("field,value", [
    ("n", True), ("n", 1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", float("nan")), ("top_k", True), ("top_k", 2.0), ("min_p", None), ("presence_penalty", float("inf")),
    ("repetition_penalty", float("nan")), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("seed", True),
    ("max_tokens", 2.0), ("min_tokens", True), ("stop", [1]), ("stop", "x\n".split("\n")),
    ("stop_token_ids", [True]), ("stop_token_ids", "1"), ("ignore_eos", 1), ("skip_special_tokens", "yes"),
    ("logprobs", -1), ("logprobs", 1.0), ("prompt_logprobs", True), ("logit_bias", {1: float("nan")}),
    ("logit_bias", {"1": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", [1]),
])
def test_sampling_params_refuse_a_value_of_the_wrong_type_or_range(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**{field: value})


def test_sampling_params_take_the_edges_of_every_range():
    p = SamplingParams(seed=2**64 - 1, top_k=2**63 - 1, temperature=1e6, top_p=1, min_p=1, presence_penalty=-2,
                       frequency_penalty=2, logit_bias={0: -1e9}, max_tokens=2**63 - 1)
    assert (p.seed, p.top_k, p.temperature) == (2**64 - 1, 2**63 - 1, 1e6)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_n_greedy_samples_are_the_greedy_output(llm):
    out = llm.generate(FRANCE, SamplingParams(n=2, temperature=0, max_tokens=3))
    assert len(out) == 1
    assert [c.index for c in out[0].outputs] == [0, 1]
    assert [c.token_ids for c in out[0].outputs] == [FRANCE_OUT[:3]] * 2
    assert [c.text for c in out[0].outputs] == [" Paris.\n"] * 2
    assert out[0].finished and all(c.finish_reason == "length" for c in out[0].outputs)


def test_n_seeded_samples_are_reproducible(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4)
    a = llm.generate(FRANCE, params)[0]
    b = llm.generate([FRANCE, FRANCE], [greedy(2), params])[1]
    assert [c.index for c in a.outputs] == [0, 1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids


def test_a_pathlib_path_is_a_model(gguf_path, llm):
    """LLM(Path(...)), as users pass paths: the same model as its string; a bad type is named."""
    import pathlib

    from_path = LLM(pathlib.Path(gguf_path), tokenizer=pathlib.Path(gguf_path), num_kv_blocks=8, quantization="none",
                    dtype="float32")  # as the session `llm`
    assert (from_path.config.model, from_path.config.tokenizer) == (str(gguf_path), str(gguf_path))
    params = SamplingParams(temperature=0, max_tokens=4)
    assert from_path.generate("Hi", params)[0].outputs[0].token_ids == llm.generate("Hi", params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="model must be a non-empty string, a path or None; got 42"):
        EngineConfig(model=42)


def test_unknown_engine_arg(gguf_path):
    with pytest.raises(TypeError, match="foo"):
        LLM(str(gguf_path), foo=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 0}, "block_size must be a positive integer, got 0"),
    ({"dtype": "fp8"}, "dtype must be one of auto, float32, bfloat16, float16; got 'fp8'"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, float16, bfloat16, float32; got 'int8'"),
    ({"kv_cache_dtype": "float8_e4m3fn"}, "kv_cache_dtype must be one of auto, fp8, fp8_e4m3, float16, bfloat16, float32; got 'float8_e4m3fn'"),
    ({"load_format": "npz"}, "load_format must be one of auto, gguf, safetensors, pt, dummy; got 'npz'"),
    ({"generation_config": "hf"}, "generation_config must be one of auto, vllm; got 'hf'"),
    ({"revision": ""}, "revision must be a non-empty string or None; got ''"),
    ({"device": "tpu"}, "device must be one of auto, cpu, cuda; got 'tpu'"),
    ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
    ({"num_kv_blocks": -3}, "num_kv_blocks must be a positive integer, got -3"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
])
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_max_model_len_longer_than_the_model(gguf_path):
    with pytest.raises(ValueError, match=rf"max_model_len=1000000000 is longer than the model's context \({CONTEXT}\)"):
        EngineConfig(model=str(gguf_path), max_model_len=10**9).resolve()


def test_resolve_fills_the_defaults(gguf_path, llm):
    c = llm.config
    assert (c.model, c.load_format, c.device, c.dtype) == (str(gguf_path), "gguf", "cpu", "float32")
    assert (c.kv_cache_dtype, c.kv_cache_torch_dtype) == ("auto", torch.float32)  # auto: the model dtype
    assert (c.max_model_len, c.max_num_batched_tokens, c.attention_backend) == (CONTEXT, 512, "torch")
    assert c.block_size == 16 and c.attention_parity_len == 3072  # 128 and None on CUDA
    assert c.model_config.vocab_size == VOCAB


# ---- a request larger than the whole KV pool --------------------------------------------------

def test_request_larger_than_the_kv_pool_is_refused_at_add_time(tiny_pool_llm):
    assert tiny_pool_llm.engine.block_pool.num_blocks == 4
    ids = (FRANCE_IDS * 20)[:100]
    with pytest.raises(ValueError, match=r"110 tokens, .*\b7 (KV )?blocks, but the whole pool has 4: lower max_tokens"):
        tiny_pool_llm.generate({"prompt_token_ids": ids}, greedy(10))
    out = tiny_pool_llm.generate(FRANCE, greedy(5))[0].outputs[0]
    assert out.token_ids == FRANCE_OUT[:5]


def test_refused_request_in_a_batch_leaves_nothing_behind(tiny_pool_llm):
    with pytest.raises(ValueError, match=r"\b7 (KV )?blocks, but the whole pool has 4"):
        tiny_pool_llm.generate([FRANCE, {"prompt_token_ids": (FRANCE_IDS * 20)[:100]}], greedy(10))


PARIS = ("Paris is the capital and largest city of France. With an estimated population of two million "
         "residents, it is the centre of the")  # 25 tokens
PLANTS = ("Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
          "glucose and oxygen. It takes place in the")  # 27 tokens
PARIS_OUT = [3432, 3575, 30, 198, 198, 504, 3575, 282, 4649, 314]  # " French capital.\n\nThe capital of France is"
PLANTS_OUT = [3711, 282, 3417, 28, 837, 357, 314, 4891, 288, 260]  # " leaves of trees, where it is carried to the"


def test_requests_that_do_not_fit_together_take_turns(tiny_pool_llm):
    """Two requests of ~26 + 10 tokens (3 blocks each at the end) in a pool of 4 blocks: both
    start with 2 blocks, then one is preempted and recomputed, and both still give the greedy
    tokens the big pool gives."""
    preemptions = tiny_pool_llm.engine.scheduler.num_preemptions
    outs = tiny_pool_llm.generate([PARIS, PLANTS], greedy(10))
    assert tiny_pool_llm.engine.scheduler.num_preemptions > preemptions
    assert [len(o.prompt_token_ids) for o in outs] == [25, 27]
    assert ids_of(outs) == [PARIS_OUT, PLANTS_OUT]
    assert [o.outputs[0].text for o in outs] == [" French capital.\n\nThe capital of France is",
                                                 " leaves of trees, where it is carried to the"]
