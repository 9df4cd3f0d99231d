"""StructuredOutputsParams.reasoning_end: the output is free until it ends with the given
token ids, then constrained. Exact on the real SmolLM2: the end sequence is taken from the
free greedy output (two of its tokens), so the gated run must equal the free run up to it
and, after it, the constrained run of a prompt that already holds those tokens."""

from __future__ import annotations

import json

import pytest

from ember import SamplingParams, StructuredOutputsParams
from ember.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
CUT = 8  # the free output's tokens 6 and 7 end the "reasoning"


@pytest.fixture(scope="module")
def prompt(llm) -> dict:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a person. Answer in JSON."}])
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


@pytest.fixture(scope="module")
def free(llm, prompt) -> list[int]:
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    ids = list(out.token_ids)
    assert ids[:CUT] == [3725, 5518, 198, 107, 472, 476, 1245, 1799]  # '```json\n{\n    "name":'
    return ids


def gated(end: list[int], max_tokens: int = 60, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, reasoning_end=end), **kw)


def test_free_until_the_end_sequence_then_the_grammar_from_its_start(llm, prompt, free):
    end = free[CUT - 2:CUT]
    forced = llm.engine.structured.num_forced_tokens
    out = llm.generate(prompt, gated(end))[0].outputs[0]
    assert llm.engine.structured.num_forced_tokens > forced  # the grammar's start was forced after the gate
    assert list(out.token_ids[:CUT]) == free[:CUT]
    answer = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + free[:CUT]},
                          SamplingParams(temperature=0, max_tokens=60 - CUT,
                                         structured_outputs=StructuredOutputsParams(json=SCHEMA)))[0].outputs[0]
    assert list(out.token_ids[CUT:]) == list(answer.token_ids)
    assert out.text == '```json\n{\n    "name":{"name": "Ava", "age": 25}'
    assert json.loads(out.text[len(llm.get_tokenizer().decode(free[:CUT])):]) == {"name": "Ava", "age": 25}
    assert out.finish_reason == "stop"


def test_each_sample_of_n_starts_in_reasoning_and_opens_its_own_gate(llm, prompt, free):
    one = llm.generate(prompt, gated(free[CUT - 2:CUT]))[0].outputs[0]
    outs = llm.generate(prompt, gated(free[CUT - 2:CUT], n=2))[0].outputs
    assert [list(o.token_ids) for o in outs] == [list(one.token_ids)] * 2


def test_an_output_that_never_ends_its_reasoning_stays_free(llm, prompt, free):
    never = [free[1], free[0]]  # not in the output
    out = llm.generate(prompt, gated(never, max_tokens=24))[0].outputs[0]
    assert list(out.token_ids) == free and out.finish_reason == "length"


def test_a_request_aborted_or_ended_by_length_while_reasoning_leaves_nothing(llm, prompt, free):
    core = llm.engine
    never = [free[1], free[0]]
    aborted = Request("gate-aborted", prompt["prompt_token_ids"], gated(never, max_tokens=40))
    ended = Request("gate-ended", prompt["prompt_token_ids"], gated(never, max_tokens=3))
    core.add_request(aborted)
    core.add_request(ended)
    while len(aborted.output_token_ids) < 5:
        core.step()
    assert core.structured._reasoning == {"gate-aborted"}  # the other ended by length, inside its reasoning
    assert ended.finish_reason == "length" and ended.output_token_ids == free[:3]
    core.abort_request("gate-aborted")
    while core.has_unfinished_requests():
        core.step()
    assert aborted.finish_reason == "abort"
    core.check_idle()


def test_bad_end_sequences_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="reasoning_end must be a non-empty list of token ids"):
        StructuredOutputsParams(json=SCHEMA, reasoning_end=[])
    with pytest.raises(ValueError, match="reasoning_end must be a non-empty list of token ids"):
        StructuredOutputsParams(json=SCHEMA, reasoning_end=[-1])
    vocab = llm.engine.config.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"reasoning_end must be token ids in \[0, {vocab}\)"):
        llm.generate(prompt, gated([vocab]))
