"""Structured output through the OpenAI server (a real `ember serve` subprocess, the
official `openai` client): `response_format` (json_schema, json_object), vLLM's
`structured_outputs` and the older `guided_*` fields, streaming, and bad constraints
refused with 400 in OpenAI's error shape while the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from servers import MODEL, assert_openai_error, post

from ember import SamplingParams, StructuredOutputsParams

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person. Answer in JSON."}]
DATE = r"\d{4}-\d{2}-\d{2}"


def offline(llm, messages, max_tokens: int, **constraint) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**constraint))
    return llm.chat(messages, params)[0].outputs[0].text


def test_response_format_json_schema_equals_offline_and_validates(client, llm):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert text == offline(llm, ASK, 48, json=PERSON)


def test_response_format_json_object_and_streaming(client, llm):
    messages = [{"role": "user", "content": "Describe a cat with a name and an age. Answer in JSON."}]
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=40, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole == offline(llm, messages, 40, json_object=True)
    assert isinstance(json.loads(whole), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": DATE}, lambda t: re.fullmatch(DATE, t)),
    ({"guided_choice": ["Paris", "Rome"]}, lambda t: t in ("Paris", "Rome")),
    ({"guided_grammar": 'root ::= [1-9] " + " [1-9]'}, lambda t: re.fullmatch(r"[1-9] \+ [1-9]", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_json": json.dumps(PERSON)}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
])
def test_completions_with_the_vllm_and_legacy_fields(client, extra, check):
    out = client.completions.create(model=MODEL, prompt="Q: Answer the question.\nA:", temperature=0,
                                    max_tokens=48, extra_body=extra)
    text = out.choices[0].text
    assert out.choices[0].finish_reason == "stop" and check(text), text


@pytest.mark.parametrize("body,words,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     ['invalid json for structured output: Unsupported type "nope"'], None),
    ({"guided_regex": "(a"}, ["invalid regex for structured output: Regex parsing error at position 3"], None),
    ({"guided_grammar": "root ::= foo"}, ['Rule "foo" is not defined'], None),
    ({"response_format": {"type": "json_schema"}}, ["response_format of type json_schema needs json_schema.schema"],
     "response_format"),
    ({"guided_json": PERSON, "guided_regex": DATE}, ["give one output constraint; got guided_json, guided_regex"],
     "guided_regex"),
    ({"structured_outputs": {"choice": []}}, ["structured_outputs: StructuredOutputsParams.choice must be"],
     "structured_outputs"),
    ({"guided_json": "{oops"}, ["guided_json: StructuredOutputsParams.json is not valid JSON"], "guided_json"),
])
def test_a_bad_constraint_gets_400_with_the_compilers_message_and_the_server_keeps_serving(server, client, body,
                                                                                           words, param):
    error = assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, **body}),
                                400, *words)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."
    server.wait_idle()


ECHO = [{"role": "user", "content": 'Echo: <function=f>{"a": 12}</function> done'}]
B_ONLY = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 8}}, "required": ["b"],
          "additionalProperties": False}
TAGS = {  # vLLM's legacy shape, and xgrammar's own
    "structures": {"structures": [{"begin": "<function=f>", "schema": B_ONLY, "end": "</function>"}],
                   "triggers": ["<function="]},
    "format": {"format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"begin": "<function=f>", "content": {"type": "json_schema", "json_schema": B_ONLY}, "end": "</function>"}]}},
}


@pytest.mark.parametrize("shape", sorted(TAGS))
def test_a_structural_tag_leaves_the_text_free_until_its_trigger_then_follows_the_schema(client, llm, shape):
    """The default model echoes the prompt: at <function=f> the tag's schema takes over, so the
    echoed {"a": 12} cannot come: a "b" string does."""
    free = llm.chat(ECHO, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    assert free.startswith('Echo: <function=f>{"a": 12}</function>')
    tag = json.dumps({"type": "structural_tag", **TAGS[shape]})
    want = offline(llm, ECHO, 30, structural_tag=tag)
    inside = want.split("<function=f>", 1)[1].split("</function>", 1)[0]
    assert want.startswith("Echo: <function=f>") and list(json.loads(inside)) == ["b"]
    r = post_chat(client, messages=ECHO, max_tokens=30, response_format={"type": "structural_tag", **TAGS[shape]})
    assert r == want


def post_chat(client, **body) -> str:
    return client.chat.completions.create(model=MODEL, temperature=0, **body).choices[0].message.content
