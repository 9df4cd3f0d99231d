"""The request-field policy on a real server (README, server/field_policy.py): OpenAI's
fields that change nothing here are accepted and logged once; vLLM's and SGLang's extras
are honoured, each with its effect checked against the offline engine, or refused by name
(test_fault_injection.py's table sends every refused one)."""

from __future__ import annotations

import json

import pytest
from servers import FRANCE, MODEL, assert_openai_error, post, serving

from ember import SamplingParams, StructuredOutputsParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

ASK = [{"role": "user", "content": "What is the capital of France?"}]
# the default model's template renders documents only through a request's own template
DOCS_TEMPLATE = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
                 "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    yield from serving(gguf_path, tmp_path_factory, "--trust-request-chat-template")


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(server, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 8,
                                             **body})
    assert r.status_code == 200, r.text
    return r.json()


def completion(server, **body) -> dict:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": FRANCE, "temperature": 0, "max_tokens": 8,
                                        **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={"model": MODEL, "temperature": 0, "stream": True, **body},
                      headers={"Authorization": "Bearer test-key"}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_openais_fields_without_effect_change_nothing_and_are_logged_once(server, llm):
    want = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    noop = {"metadata": {"team": "search"}, "store": False, "service_tier": "auto", "user": "u1",
            "safety_identifier": "s1", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
            "prediction": {"type": "content", "content": "Paris"}, "verbosity": "medium", "modalities": ["text"],
            "use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True,
            "vllm_xargs": {}}
    for _ in range(2):
        assert chat(server, **noop)["choices"][0]["message"]["content"] == want
    assert chat(server, spaces_between_special_tokens=False)["choices"][0]["message"]["content"] == want
    streamed = events(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "stream_options":
                                                       {"include_usage": True, "include_obfuscation": True}})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]) == want
    log = server.log.read_text()
    for name in ("metadata", "store", "service_tier", "user", "prompt_cache_key", "prediction",
                 "include_obfuscation", "spaces_between_special_tokens"):
        assert log.count(f"request field {name}: accepted, no effect") == (0 if name == "store" else 1), name


def test_request_id_names_the_response(server):
    assert chat(server, request_id="job-7")["id"] == "chatcmpl-job-7"
    assert completion(server, rid="job-8")["id"] == "cmpl-job-8"
    assert_openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "request_id": "a",
                                                         "rid": "b"}), 400, "request_id or rid")


def test_return_token_ids_gives_the_prompt_and_each_choices_ids(server, llm):
    tok = llm.get_tokenizer()
    ref = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8))[0]
    out = completion(server, return_token_ids=True)
    assert out["choices"][0]["prompt_token_ids"] == tok.encode(FRANCE) == ref.prompt_token_ids
    assert out["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    assert "token_ids" not in completion(server)["choices"][0]  # only where asked
    streamed = events(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 8, "return_token_ids": True})
    assert streamed[0]["choices"][0]["prompt_token_ids"] == ref.prompt_token_ids
    assert [t for e in streamed for t in e["choices"][0]["token_ids"]] == ref.outputs[0].token_ids

    want = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8))[0]
    answer = chat(server, return_token_ids=True)
    assert (answer["prompt_token_ids"], answer["choices"][0]["token_ids"]) == (want.prompt_token_ids,
                                                                               want.outputs[0].token_ids)
    assert "prompt_token_ids" not in chat(server)
    streamed = events(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "return_token_ids": True})
    assert streamed[0]["prompt_token_ids"] == want.prompt_token_ids
    assert [t for e in streamed for t in e["choices"][0].get("token_ids") or []] == want.outputs[0].token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, llm):
    ref = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    out = completion(server, max_tokens=4, logprobs=2, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert out["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in out["top_logprobs"])
    content = chat(server, max_tokens=4, logprobs=True, top_logprobs=1,
                   return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    want = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in want]
    assert [c["top_logprobs"][0]["token"] for c in content] == [f"token_id:{t}" for t in want]  # greedy: the top
    assert content[0]["bytes"] == list(f"token_id:{want[0]}".encode())


def test_truncate_prompt_tokens_keeps_the_last_k(server, llm):
    ids = llm.get_tokenizer().encode(FRANCE)
    ref = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(temperature=0, max_tokens=8))[0]
    out = completion(server, truncate_prompt_tokens=3, return_token_ids=True)
    assert (out["usage"]["prompt_tokens"], out["choices"][0]["prompt_token_ids"]) == (3, ids[-3:])
    assert out["choices"][0]["text"] == ref.outputs[0].text
    assert completion(server, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == len(ids)
    assert chat(server, truncate_prompt_tokens=5)["usage"]["prompt_tokens"] == 5
    error = assert_openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                                 "truncate_prompt_tokens": 10**6}), 400, "max_model_len")
    assert error["param"] == "truncate_prompt_tokens"


def test_best_of_equal_to_n_is_n(server):
    body = dict(n=2, temperature=0.8, seed=1)
    assert [c["text"] for c in completion(server, best_of=2, **body)["choices"]] == \
        [c["text"] for c in completion(server, **body)["choices"]]


def test_continue_final_message_and_echo_continue_the_assistants_text(server, llm):
    opened = ASK + [{"role": "assistant", "content": "The capital of France is"}]
    tok = llm.get_tokenizer()
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
              "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
              "The capital of France is")
    ref = llm.generate({"prompt_token_ids": tok.encode(prompt)}, SamplingParams(temperature=0, max_tokens=8))[0]
    body = dict(messages=opened, add_generation_prompt=False, continue_final_message=True, return_token_ids=True)
    out = chat(server, **body)
    assert out["prompt_token_ids"] == tok.encode(prompt)
    assert out["choices"][0]["message"]["content"] == ref.outputs[0].text
    echoed = chat(server, **body, echo=True)["choices"][0]["message"]["content"]
    assert echoed == "The capital of France is" + ref.outputs[0].text
    streamed = events(server, "/v1/chat/completions", {**body, "echo": True, "max_tokens": 8})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed if e["choices"]) == echoed
    assert chat(server, echo=True)["choices"][0]["message"]["content"] == \
        chat(server)["choices"][0]["message"]["content"]  # the last message is the user's: nothing to echo
    assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": opened,
                                                              "continue_final_message": True}),
                        400, "add_generation_prompt false")


def test_a_requests_chat_template_documents_and_reasoning_effort(server, llm):
    tok = llm.get_tokenizer()
    docs = [{"title": "Atlas", "text": "Paris is the capital of France."}]
    out = chat(server, chat_template=DOCS_TEMPLATE, documents=docs, reasoning_effort="low", return_token_ids=True)
    prompt = ("[Atlas] Paris is the capital of France.\neffort=low\n<|im_start|>user\nWhat is the capital of "
              "France?<|im_end|>\n<|im_start|>assistant")  # Jinja drops a template's last newline, as in HF
    assert out["prompt_token_ids"] == tok.encode(prompt)
    ref = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out["choices"][0]["message"]["content"] == ref.text
    error = assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": ASK,
                                                                      "reasoning_effort": "low"}),
                                400, "no reasoning_effort variable")
    assert error["param"] == "reasoning_effort"


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, llm):
    ref = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=6))[0]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": FRANCE}), ("/v1/chat/completions", {"messages": ASK})):
        streamed = events(server, path, {**body, "max_tokens": 6, "stream_options": opts})
        used = [e["usage"]["completion_tokens"] for e in streamed]
        assert all(e["usage"] is not None for e in streamed) and used == sorted(used) and used[-1] == 6
        if path == "/v1/completions":
            assert streamed[-1]["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    plain = events(server, "/v1/completions", {"prompt": FRANCE, "max_tokens": 6,
                                               "stream_options": {"include_usage": True}})
    assert [e["usage"] is not None for e in plain] == [False] * (len(plain) - 1) + [True]


def test_sglangs_regex_and_ebnf_constrain_the_output(server, llm):
    for field, constraint in (("regex", StructuredOutputsParams(regex="(Paris|Rome), France")),
                              ("ebnf", StructuredOutputsParams(grammar='root ::= "yes" | "no"'))):
        want = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8, structured_outputs=constraint))
        value = constraint.regex or constraint.grammar
        assert completion(server, **{field: value})["choices"][0]["text"] == want[0].outputs[0].text
    assert want[0].outputs[0].text == "no"  # the grammar, not the model's " Paris", decided


def test_allowed_token_ids_and_bad_words_equal_their_logit_bias_spelling(server, llm):
    """Greedy, a ban is a -100 bias and "only these" a +100 one (the model's logits span less):
    the offline engine's plain logit_bias path is the reference."""
    tok = llm.get_tokenizer()
    paris = [tok.encode(w, add_special_tokens=False) for w in ("Paris", " Paris")]
    assert all(len(ids) == 1 for ids in paris)  # one token each: the bias bans exactly them
    banned = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8,
                                                 logit_bias={ids[0]: -100 for ids in paris}))[0].outputs[0]
    out = completion(server, bad_words=["Paris"], return_token_ids=True)["choices"][0]
    assert out["token_ids"] == banned.token_ids and "Paris" not in out["text"]
    assert completion(server)["choices"][0]["text"].startswith(" Paris")  # what the ban changed

    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" London", " Rome", ".", " the")]
    only = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=8,
                                               logit_bias={t: 100 for t in allowed}))[0].outputs[0]
    out = completion(server, allowed_token_ids=allowed, return_token_ids=True)["choices"][0]
    assert out["token_ids"] == only.token_ids and set(out["token_ids"]) <= set(allowed)
    assert chat(server, allowed_token_ids=allowed, return_token_ids=True)["choices"][0]["token_ids"] == \
        llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed))[0].outputs[0].token_ids



def test_cache_salt_keeps_a_prompts_cached_blocks_to_its_salt(server):
    # words no other request of this server begins with: a hit can come only from this test's requests
    prompt = "Salted: " + FRANCE + " and this sentence runs long enough to fill more than one block." * 2
    cached = []
    for salt in ("team-a", "team-a", "team-b", None, None):
        body = {"prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        cached.append(completion(server, **body)["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] > 16  # the second of a salt hits the first's blocks
    assert cached[2:4] == [0, 0]  # another salt, or none, does not
    assert cached[4] == cached[1]
