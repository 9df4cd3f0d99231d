"""SGLang's native API on `ember serve` (/generate, /get_model_info, /get_server_info,
/flush_cache) over a real uvicorn, and ember.lang's RuntimeEndpoint on it: the same program
gives the same outputs as on the in-process LLM."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import FRANCE, KEY, MODEL, assert_openai_error, post

import ember.lang as sgl

pytestmark = pytest.mark.usefixtures("still_serving")


def test_generate_text_and_batches_of_ids_with_logprobs(server, client):
    body = {"text": FRANCE, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    one = post(server, "/generate", body).json()
    ref = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=6, temperature=0)
    assert one["text"] == ref.choices[0].text
    assert one["meta_info"]["completion_tokens"] == len(one["output_ids"]) == ref.usage.completion_tokens
    assert one["meta_info"]["finish_reason"]["type"] in ("stop", "length")

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": FRANCE}, headers={"Authorization": f"Bearer {KEY}"}
                     ).json()["tokens"]
    batch = post(server, "/generate", {
        "input_ids": [ids, ids[:3]], "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True, "logprob_start_len": [2, 0], "top_logprobs_num": 2,
        "return_text_in_logprobs": True}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    first, second = batch[0]["meta_info"], batch[1]["meta_info"]
    assert [e[1] for e in first["input_token_logprobs"]] == ids[2:]
    assert second["input_token_logprobs"][0][0] is None and len(second["input_token_logprobs"]) == 3
    assert [e[1] for e in first["output_token_logprobs"]] == one["output_ids"]
    assert all(len(tops) == 2 and tops[0][0] >= tops[1][0] for tops in first["output_top_logprobs"])
    assert first["output_token_logprobs"][0][2] == client.completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=1, temperature=0).choices[0].text


def test_generate_streams_the_text_so_far(server):
    body = {"text": FRANCE, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    whole = post(server, "/generate", body).json()["text"]
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True, "return_logprob": True},
                      timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and len(events) > 2
    answers = [json.loads(e) for e in events[:-1]]
    assert answers[-1]["text"] == whole and all(whole.startswith(a["text"]) for a in answers)
    last = answers[-1]["meta_info"]
    assert len(last["output_token_logprobs"]) == last["completion_tokens"] == len(answers[-1]["output_ids"])
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": FRANCE}, headers={"Authorization": f"Bearer {KEY}"}
                     ).json()["tokens"]
    assert [e[1] for e in last["input_token_logprobs"]] == ids[-1:]  # SGLang's default start: the last prompt token


def test_fields_ember_does_not_honour_are_refused_by_name(server):
    for body, word in (({"text": "x", "image_data": "a.png"}, "image_data"),
                       ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "stop_regex"),
                       ({"text": "x", "sampling_params": {"max_new_tokens": 2, "nonsense": 1}}, "nonsense"),
                       ({"text": "x", "input_ids": [1]}, "exactly one of text and input_ids"),
                       ({"text": ["x", "y"], "stream": True}, "stream takes one prompt")):
        assert_openai_error(post(server, "/generate", body), 400, word)


def test_model_and_server_info_and_flush_cache(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(f"{server.url}/get_model_info", headers=auth).json()
    assert info["is_generation"] is True and info["model_path"].endswith(".gguf")
    server_info = httpx.get(f"{server.url}/get_server_info", headers=auth).json()
    assert server_info["page_size"] > 0 and server_info["context_length"] > 0
    assert httpx.post(f"{server.url}/flush_cache", headers=auth).status_code == 200


@sgl.function
def program(s, topic):
    s += sgl.system("You answer in a few words.")
    s += sgl.user(f"Name a {topic}.")
    s += sgl.assistant(sgl.gen("name", max_tokens=8, temperature=0))
    s += sgl.user("Is it big?")
    s += sgl.assistant(sgl.select("big", choices=["Yes", "No", "Maybe"]))
    s += "\nHow many letters: " + sgl.gen_int("letters", max_tokens=4, temperature=0)
    forks = s.fork(2)
    forks += lambda i: f"\nFact {i + 1}:" + sgl.gen("fact", max_tokens=6, temperature=0, stop="\n")
    forks.join()


def test_a_program_gives_the_same_outputs_in_process_and_over_http(server, llm):
    local = sgl.LocalBackend(llm)
    remote = sgl.RuntimeEndpoint(server.url, api_key=KEY)
    try:
        here = program.run_batch([{"topic": "fruit"}, {"topic": "tree"}], backend=local)
        there = program.run_batch([{"topic": "fruit"}, {"topic": "tree"}], backend=remote)
        for a, b in zip(here, there):
            assert b.error() is None, b.error()
            assert a.text() == b.text() and a.messages() == b.messages()
            assert a.token_ids() == b.token_ids()
            for name in ("name", "big", "letters", "fact"):
                assert a[name] == b[name]
            assert b.get_meta_info("big")["normalized_prompt_logprobs"] == pytest.approx(
                a.get_meta_info("big")["normalized_prompt_logprobs"], abs=1e-4)
        streamed = program.run(topic="fruit", backend=remote, stream=True)
        assert "".join(streamed.text_iter()) == here[0].text()
        with pytest.raises(ValueError, match="stop_token_ids"):  # the server's 400, as the engine's check raises
            sgl.function(lambda s: s.__iadd__("x" + sgl.gen("y", stop_token_ids=[10 ** 9]))).run(backend=remote)
    finally:
        local.shutdown()
        remote.shutdown()
