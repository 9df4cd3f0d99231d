"""Structured output end to end on the real SmolLM2: every constrained output parses and
validates (JSON schema with jsonschema, regex with re.fullmatch, choice, an EBNF grammar
with a small parser), free requests in the same batch are untouched, streaming,
jump-forward, both backends, and bad constraints refused at the boundary."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from ember import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                             "required": ["name", "age"]}),
    ("Describe a book.", {"type": "object", "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                                                          "author": NAME}, "required": ["title", "pages", "author"]}),
    ("Name three colours.", {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                                          "minItems": 3, "maxItems": 3}},
                             "required": ["colours"]}),
    ("Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Pick a traffic light colour.", {"type": "object", "properties": {"light": {"enum": ["red", "amber", "green"]}},
                                       "required": ["light"]}),
    ("Give the temperature in Paris.", {"type": "object", "properties": {"city": NAME, "celsius": {"type": "number", "minimum": -50,
                                                                                                 "maximum": 50}},
                                        "required": ["city", "celsius"]}),
    ("Describe a company and its address.", {"type": "object", "properties": {
        "company": NAME, "address": {"type": "object", "properties": {"street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                     "required": ["street", "city", "zip"]}}, "required": ["company", "address"]}),
    ("List two fruits with their prices.", {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["name", "price"]}}},
        "required": ["fruits"]}),
    ("Rate this movie from 1 to 5.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                                                      "review": {"type": "string", "pattern": "^[A-Za-z ,.!']{1,40}$"}},
                                      "required": ["stars", "review"]}),
    ("What is the weather like?", {"type": "object", "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                                                                    "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200}},
                                   "required": ["sky", "wind_kmh"]}),
    ("Give a username.", {"type": "object", "properties": {"username": {"type": "string", "minLength": 3, "maxLength": 8}},
                          "required": ["username"]}),
    ("Give some numbers.", {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                                         "minItems": 2, "maxItems": 4}},
                            "required": ["numbers"]}),
    ("Describe a dog.", {"type": "object", "properties": {"name": NAME, "breed": NAME, "good": {"type": "boolean"}},
                         "required": ["name", "breed", "good"]}),
    ("Give coordinates of a point.", {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                                      "y": {"type": "number", "minimum": -10, "maximum": 10}},
                                      "required": ["x", "y"]}),
    ("Describe a car.", {"type": "object", "properties": {"make": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                                          "electric": {"type": "boolean"}},
                         "required": ["make", "year"]}),
    ("Plan a meeting.", {"type": "object", "properties": {"topic": NAME, "attendees": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
                                                          "room": {"enum": ["A", "B", "C"]}},
                         "required": ["topic", "attendees", "room"]}),
    ("Classify this email: 'You won a prize!'", {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                                                                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
                                                 "required": ["label", "confidence"]}),
    ("Describe a country.", {"type": "object", "properties": {"country": NAME, "capital": NAME,
                                                              "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}},
                             "required": ["country", "capital", "population_millions"]}),
    ("Give a to-do item.", {"type": "object", "properties": {"task": {"type": "string", "minLength": 2, "maxLength": 30},
                                                             "done": {"type": "boolean"},
                                                             "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
                            "required": ["task", "done", "priority"], "additionalProperties": False}),
    ("Describe a student and grades.", {"type": "object", "properties": {
        "student": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]},
        "grades": {"type": "array", "items": {"enum": ["A", "B", "C", "D"]}, "minItems": 1, "maxItems": 3}},
        "required": ["student", "grades"]}),
]
assert len(SCHEMAS) == 20

REGEXES = [
    ("When was the Eiffel Tower built? Answer with a date.", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("What is the email of John at example.com?", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)"),
    ("Give a US phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("What time is it?", r"([01]\d|2[0-3]):[0-5]\d"),
]
# sums and products of small numbers, at most four terms: always complete within max_tokens
ARITHMETIC = 'root ::= num (op num){1,3}\nop ::= " + " | " - " | " * "\nnum ::= [1-9] [0-9]?'
ARITHMETIC_RE = re.compile(r"[1-9][0-9]?( [+\-*] [1-9][0-9]?){1,3}")
MAX_TOKENS = 96


def chat(llm, question: str) -> dict:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": question + " Answer in JSON."}])
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def constrained(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kw))


def test_twenty_json_schemas_parse_and_validate(llm):
    outs = llm.generate([chat(llm, q) for q, _ in SCHEMAS], [constrained(json=s) for _, s in SCHEMAS])
    for (question, schema), out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (question, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_and_grammar_outputs_match_and_free_requests_are_untouched(llm):
    """One batch mixes every kind of constraint with free requests; the free ones give the
    same tokens as when they run alone (the mask touches only constrained rows)."""
    free_prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(free_prompts, free)
    choices = [("What is the capital of France?", ["Paris", "London", "Berlin"]),
               ("Is water wet? Say yes or no.", ["yes", "no"])]
    prompts = [chat(llm, q) for q, _ in REGEXES] + [chat(llm, q) for q, _ in choices] + \
        [chat(llm, "Write a sum of three small numbers.")] + free_prompts
    params = [constrained(32, regex=r) for _, r in REGEXES] + [constrained(8, choice=c) for _, c in choices] + \
        [constrained(32, grammar=ARITHMETIC)] + [free] * len(free_prompts)
    outs = llm.generate(prompts, params)
    for (question, regex), out in zip(REGEXES, outs):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(regex, out.outputs[0].text), \
            (question, out.outputs[0].text)
    for (question, options), out in zip(choices, outs[len(REGEXES):]):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in options, out.outputs[0].text
    sum_out = outs[len(REGEXES) + len(choices)].outputs[0]
    assert sum_out.finish_reason == "stop" and ARITHMETIC_RE.fullmatch(sum_out.text), sum_out.text
    assert eval(sum_out.text) == eval(sum_out.text.replace(" ", ""))  # it is arithmetic python can evaluate
    for a, b in zip(alone, outs[-len(free_prompts):]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids and len(a.outputs[0].token_ids) == 12


def test_a_choice_with_quotes_and_a_json_object(llm):
    options = ['say "hi"', "say 'bye'", "back\\slash"]
    outs = llm.generate([chat(llm, "Pick one."), chat(llm, "Describe a cat with a name and an age.")],
                        [constrained(12, choice=options), constrained(40, json_object=True)])
    assert outs[0].outputs[0].text in options
    assert outs[1].outputs[0].finish_reason == "stop", outs[1].outputs[0].text
    assert json.loads(outs[1].outputs[0].text) == {"name": "Frodo", "age": 12}


def test_streaming_gives_the_same_valid_json(llm):
    question, schema = SCHEMAS[6]
    params = constrained(json=schema)
    texts = [out.outputs[0].text for out in llm.stream(chat(llm, question), params)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(texts) > 3
    final = llm.generate(chat(llm, question), params)[0].outputs[0]
    assert texts[-1] == final.text
    jsonschema.validate(json.loads(final.text), schema)


def test_jump_forward_appends_forced_tokens_and_the_output_still_validates(llm, extra_llm):
    """With jump-forward the grammar's forced text (keys, separators) is appended without a
    forward each: fewer engine steps, the same kind of valid output."""
    plain = extra_llm(structured_outputs_jump_forward=False)
    picked = [SCHEMAS[i] for i in (0, 1, 6, 19)]
    prompts = [chat(llm, q) for q, _ in picked]
    params = [constrained(json=s) for _, s in picked]

    def run(engine):
        steps, forced = 0, engine.engine.structured.num_forced_tokens
        real_step = engine.engine.step

        def counting_step():
            nonlocal steps
            steps += 1
            return real_step()

        engine.engine.step = counting_step
        try:
            outs = engine.generate(prompts, params)
        finally:
            del engine.engine.step
        return outs, steps, engine.engine.structured.num_forced_tokens - forced

    jumped, jumped_steps, forced = run(llm)
    sampled, sampled_steps, none_forced = run(plain)
    assert none_forced == 0 and forced > 10
    for (_, schema), a, b in zip(picked, jumped, sampled):
        jsonschema.validate(json.loads(a.outputs[0].text), schema)
        jsonschema.validate(json.loads(b.outputs[0].text), schema)
    assert jumped_steps < sampled_steps
    # a schema whose whole output is forced but the last token: one sampled token finishes it
    out = llm.generate(chat(llm, "Say ok."), constrained(json={"const": {"status": "ok"}}))[0].outputs[0]
    assert json.loads(out.text) == {"status": "ok"}


def test_the_guidance_backend_gives_valid_output_too(extra_llm):
    guided = extra_llm(structured_outputs_backend="guidance")
    picked = [SCHEMAS[i] for i in (0, 2, 4, 16)]
    prompts = [chat(guided, q) for q, _ in picked] + [chat(guided, REGEXES[0][0]), chat(guided, "Pick a city."),
                                                      chat(guided, "Write a sum.")]
    params = [constrained(json=s) for _, s in picked] + [constrained(32, regex=REGEXES[0][1]),
                                                         constrained(8, choice=["Rome", "Oslo"]),
                                                         constrained(32, grammar=ARITHMETIC)]
    outs = guided.generate(prompts, params)
    for (_, schema), out in zip(picked, outs):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    regex, choice, arithmetic = (o.outputs[0] for o in outs[len(picked):])
    assert re.fullmatch(REGEXES[0][1], regex.text), regex.text
    assert choice.text in ("Rome", "Oslo") and choice.finish_reason == "stop"
    assert ARITHMETIC_RE.fullmatch(arithmetic.text), arithmetic.text
    with pytest.raises(ValueError, match="invalid regex"):
        guided.generate("x", constrained(regex="(a"))


@pytest.mark.parametrize("constraint,message", [
    ({"json": {"type": "nope"}}, 'invalid json for structured output: Unsupported type "nope"'),
    ({"json": {"type": "string", "minLength": "x"}}, "invalid json for structured output: minLength must be an integer"),
    ({"regex": "(a"}, "invalid regex for structured output: Regex parsing error at position 3: The parenthesis "
                      "is not closed."),
    ({"grammar": "root ::= foo"}, 'invalid grammar for structured output: EBNF parser error at line 1, column 10: '
                                  'Rule "foo" is not defined'),
])
def test_a_bad_constraint_is_refused_at_the_boundary_with_the_compilers_message(llm, constraint, message):
    with pytest.raises(ValueError) as e:
        llm.generate(["Hi", "Hello"], [SamplingParams(max_tokens=2), constrained(**constraint)])
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
    assert llm.engine.structured.num_compiling == 0 and not llm.engine.scheduler.requests


def test_n_samples_of_a_constrained_request_each_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8} (is|was) (red|blue)"))
    out = llm.generate(chat(llm, "What colour is the sky?"), params)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"[A-Z][a-z]{2,8} (is|was) (red|blue)", c.text), c.text


def test_a_request_whose_grammar_compiles_waits_without_stalling_the_others(llm):
    """While a grammar compiles (held here by an event around the real compile), the free
    request runs; the constrained one stays out of the scheduler, then runs when ready.
    Aborting a request that waits for its grammar leaves nothing behind."""
    core = llm.engine
    backend = core.structured.backend
    gate = threading.Event()
    real_compile = backend.compile

    def held_compile(params):
        gate.wait(60)
        return real_compile(params)

    backend.compile = held_compile
    schema = {"type": "object", "properties": {"held": {"type": "integer"}}, "required": ["held"]}
    try:
        free = llm.inputs.make_request("free", "The capital of France is", SamplingParams(temperature=0, max_tokens=4))
        held = llm.inputs.make_request("held", chat(llm, "Give a number."), constrained(16, json=schema))
        core.add_request(held)
        core.add_request(free)
        for _ in range(4):
            core.step()
        assert free.status.is_finished and len(free.output_token_ids) == 4
        assert held.request_id not in core.scheduler.requests and core.structured.num_compiling == 1
        assert not held.output_token_ids and core.has_unfinished_requests()
        gate.set()
        while core.has_unfinished_requests():
            core.step()
        assert held.finish_reason == "stop"
        assert list(json.loads(llm.get_tokenizer().decode(held.output_token_ids[:-1]))) == ["held"]
        gate.clear()
        schema["properties"]["other"] = {"type": "string"}  # a new key: compiled afresh, held again
        aborted = llm.inputs.make_request("aborted", "Hi", constrained(8, json=schema))
        core.add_request(aborted)
        core.step()
        assert core.structured.num_compiling == 1
        core.abort_request("aborted")
        assert core.structured.num_compiling == 0 and not core.has_unfinished_requests()
    finally:
        gate.set()
        del backend.compile
