"""The OpenAI-compatible server, end to end: a real `ember serve` (uvicorn on 127.0.0.1, in a
subprocess) on the default model in float32, driven by the official `openai` client.

Every text is checked against the offline API (`LLM.generate` / `.chat`, the session `llm`
fixture) on the same model with the same SamplingParams: the server must add nothing and
lose nothing. Bad input gets its status in OpenAI's error shape, and the server keeps
serving after each. A second, small server (max_num_seqs=1, max_waiting_requests=1) tests
the 503 and SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal

import pytest
from sampling import greedy
from servers import FRANCE, KEY, MODEL, Server, assert_openai_error, post

from ember import SamplingParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("still_serving")]

CONTEXT = 8192

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,",
    "The quick brown fox", "Water boils at", "My favourite colour is", "In 1492, Columbus",
    "The best way to learn Python is", "Roses are red,", "import numpy as np\n", "The sun rises in the",
    "Dear Sir or Madam,", "The three primary colours are", "Mount Everest is", "A haiku about autumn:",
]


# ---- readiness, models, tokenize ---------------------------------------------------------


def test_health_is_503_until_the_model_is_loaded_then_200(server):
    assert set(server.health_seen[:-1]) <= {503} and server.health_seen[-1] == 200
    assert 503 in server.health_seen, "the server should answer /health while the model loads"


def test_every_route_that_takes_input_needs_the_key_but_health_and_version(server, client):
    models = client.models.list()
    assert [(m.id, m.root) for m in models.data] == [(MODEL, MODEL)]  # the served name, never a path
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200
    for method, path in [("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/nowhere")]:
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "hi"})
        assert_openai_error(r, 401, "API key")
    keyed = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert "ember:kv_cache_usage_perc" in keyed.text


def test_tokenize_and_detokenize(server, llm):
    tok = llm.get_tokenizer()
    r = post(server, "/tokenize", {"prompt": FRANCE}).json()
    assert r["tokens"] == tok.encode(FRANCE) and r["count"] == len(r["tokens"]) and r["max_model_len"] == CONTEXT
    r = post(server, "/tokenize", {"messages": CHAT}).json()
    assert r["tokens"] == llm.inputs.chat_prompt(CHAT)["prompt_token_ids"]
    assert post(server, "/detokenize", {"tokens": tok.encode(FRANCE)}).json() == {"prompt": FRANCE}
    ids = [1, 4093, 198] + tok.encode(FRANCE) + [2]  # <|im_start|>user\n ... <|im_end|>
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == f"<|im_start|>user\n{FRANCE}<|im_end|>"
    assert post(server, "/detokenize", {"tokens": ids, "skip_special_tokens": True}).json() == {
        "prompt": f"user\n{FRANCE}"}
    assert_openai_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, "token ids")


# ---- chat and completions against the offline API ----------------------------------------


def test_chat_equals_offline_greedy_with_exact_usage(client, llm):
    ref = llm.chat(CHAT, greedy(24))[0]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_equals_offline_greedy(client, llm):
    ref = llm.chat(CHAT, greedy(24))[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason] == ["stop"]
    assert content[-1].choices[0].finish_reason == "stop"
    assert not chunks[-1].choices and chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_equals_offline_greedy_streamed_or_not(client, llm):
    ref = llm.generate(FRANCE, greedy(12))[0]
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=12, temperature=0)
    assert out.choices[0].text == ref.outputs[0].text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    chunks = list(client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ref.prompt_token_ids), 12)


def test_completion_takes_token_ids_and_lists_of_prompts(client, llm):
    refs = llm.generate(PROMPTS[:3], greedy(6))
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    ids = llm.get_tokenizer().encode(FRANCE)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == refs[0].outputs[0].text


def test_n2_seeded_samples_equal_offline(client, llm):
    params = dict(temperature=0.9, seed=7)
    ref = llm.generate(FRANCE, SamplingParams(n=2, max_tokens=10, **params))[0]
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=10, n=2, **params)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [c.text for c in ref.outputs]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs) == 20
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, n=2, stream=True, **params)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.text for c in llm.chat(CHAT, SamplingParams(n=2, max_tokens=10, **params))[0].outputs]


@pytest.mark.parametrize("stop", ["\n", ["The answer", "xyz"], " is:"])
def test_stop_strings_cut_the_text_as_offline_streamed_or_not(client, llm, stop):
    ref = llm.generate(FRANCE, greedy(16, stop=stop))[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason in ([stop] if isinstance(stop, str) else stop)
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0, stop=stop)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs_equal_offline(client, llm):
    ref = llm.chat(CHAT, greedy(6, logprobs=2))[0].outputs[0]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == len(ref.logprobs)
    for entry, tid, lps in zip(content, ref.token_ids, ref.logprobs):
        assert entry.token == lps[tid].decoded_token
        assert entry.logprob == pytest.approx(lps[tid].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token is the one taken
    streamed = [lp for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in out.choices[0].logprobs.content)


def test_completion_logprobs_equal_offline(client, llm):
    ref = llm.generate(FRANCE, greedy(5, logprobs=3))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == ref.text
    assert lp.token_logprobs == pytest.approx([d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)], abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_sampling_parameters_reach_the_sampler(client, llm):
    """Every knob the server maps, checked against the offline API with the same values."""
    knobs = dict(temperature=0.7, top_p=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.3)
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2)
    ref = llm.generate(FRANCE, SamplingParams(max_tokens=12, **knobs, **extra))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=12, extra_body=extra, **knobs)
    assert out.choices[0].text == ref.text
    # logit_bias: +100 on one token makes it the only choice
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0,
                                    logit_bias={"7042": 100}, logprobs=0)
    assert out.choices[0].logprobs.tokens == [" Paris"] * 4
    # ignore_eos: a chat that would stop at <|im_end|> runs to max_tokens
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 30 and out.choices[0].finish_reason == "length"


def test_metrics_count_tokens_requests_and_latencies_exactly(server, client):
    before = server.metrics()
    a = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=5, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    assert (a.choices[0].finish_reason, b.choices[0].finish_reason) == ("length", "stop")
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert moved("prompt_tokens_total") == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert moved("generation_tokens_total") == a.usage.completion_tokens + b.usage.completion_tokens
    assert moved('request_success_total{finished_reason="length"}') == 1
    assert moved('request_success_total{finished_reason="stop"}') == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert moved(f"{name}_count") == 2, name
        assert moved(f"{name}_sum") >= 0, name
    assert moved("inter_token_latency_seconds_count") == a.usage.completion_tokens + b.usage.completion_tokens - 2
    assert after["e2e_request_latency_seconds_sum"] - before["e2e_request_latency_seconds_sum"] >= \
        after["time_to_first_token_seconds_sum"] - before["time_to_first_token_seconds_sum"]
    assert after["num_preemptions_total"] == 0


def test_a_repeated_prompt_reports_cached_tokens_in_usage_and_metrics(server, client):
    prompt = [5000 + 7 * i for i in range(45)]  # ids no other test sends: 2 full blocks of 16, then 13
    before = server.metrics()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = server.metrics()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 44  # all but the last: its logits are asked for
    assert second.choices[0].text == first.choices[0].text
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == 2 * 45
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == 44
    # a prompt over the step's token budget (512 on the CPU): its admission step has no output
    long = client.completions.create(model=MODEL, prompt=prompt * 14, max_tokens=1, temperature=0)
    assert long.usage.prompt_tokens == 630 and long.usage.prompt_tokens_details.cached_tokens >= 32
    final = server.metrics()
    assert final["prefix_cache_queries_total"] - after["prefix_cache_queries_total"] == 630
    assert final["prefix_cache_hits_total"] - after["prefix_cache_hits_total"] == \
        long.usage.prompt_tokens_details.cached_tokens


# ---- bad input: its status, OpenAI's error shape, and the server keeps serving ----------------

LONG = [504] * (CONTEXT + 8)

BAD_REQUESTS = [
    # (path, body, status, words in the message, param)
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "top_p": 3}, 400, ["top_p"], "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "temperature": -1}, 400, ["temperature"], "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}, 400, ["n"], "n"),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": "many"}, 400, ["max_tokens"], None),
    ("/v1/completions", '{"model": "smol", "prompt": ', 400, ["JSON"], None),
    ("/v1/chat/completions", "[1, 2", 400, ["JSON"], None),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, ["messages"], "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, ["empty"], None),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, [str(len(LONG)), str(CONTEXT)], None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * CONTEXT}]}, 400,
     [str(CONTEXT), "max_model_len"], None),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**7]}, 400, ["[0, 49152)"], None),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "logit_bias": {"x": 1}}, 400, ["logit_bias"],
     "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "logit_bias": {"99999999": 1}}, 400, ["logit_bias"],
     None),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     ["top_logprobs"], "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 2}, 400, ["logprobs"],
     "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": FRANCE, "stream_options": {"include_usage": True}}, 400,
     ["stream"], "stream_options"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": FRANCE}, 404, ["gpt-4o"], "model"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, 404, ["gpt-4o"], "model"),
]


@pytest.mark.parametrize("path,body,status,words,param", BAD_REQUESTS,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_its_status_in_openai_shape(server, path, body, status, words, param):
    error = assert_openai_error(post(server, path, body), status, *words)
    if param is not None:
        assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_the_openapi_schema_documents_the_statuses_the_server_sends(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert set(responses) == {"200", "400", "401", "404", "413", "500", "503"}
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["additionalProperties"] is False  # an unknown field is refused
    seed = request["properties"]["seed"]["anyOf"][0]
    assert (seed["type"], seed["minimum"], float(seed["maximum"])) == ("integer", -(2**63), float(2**64 - 1))


def test_the_official_client_raises_its_own_error_types(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=FRANCE, top_p=3)
    assert e.value.status_code == 400 and "top_p" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_a_missing_or_wrong_api_key_gets_401(server, headers):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": FRANCE}, headers=headers)
    error = assert_openai_error(r, 401, "API key")
    assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()


# ---- disconnects, concurrency ------------------------------------------------------------


def test_a_client_dropped_mid_stream_leaves_no_block_in_use(server, client):
    stream = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    busy = server.metrics()
    assert busy["kv_cache_usage_perc"] > 0 and busy["num_requests_running"] == 1
    stream.close()  # the client goes away mid-stream
    server.wait_idle(timeout=15)


def test_a_client_gone_before_a_non_streamed_answer_frees_its_request(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5,
                   json={"model": MODEL, "prompt": FRANCE, "max_tokens": 2000, "ignore_eos": True})
    server.wait_idle(timeout=15)


def test_32_concurrent_streaming_clients_get_their_offline_greedy_text(server, llm):
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]  # every prompt as a chat ...
    texts = list(PROMPTS)  # ... and as a completion
    assert len(chats) + len(texts) == 32
    ref_chat = [o.outputs[0].text for o in llm.chat(chats, greedy(16))]
    ref_text = [o.outputs[0].text for o in llm.generate(texts, greedy(16))]

    async def run() -> tuple[list[str], list[str]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        async def chat(messages) -> str:
            stream = await aclient.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                           temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def complete(prompt) -> str:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            results = await asyncio.gather(*[chat(m) for m in chats], *[complete(t) for t in texts])
        finally:
            await aclient.close()
        return list(results[:len(chats)]), list(results[len(chats):])

    got_chat, got_text = asyncio.run(run())
    assert got_chat == ref_chat
    assert got_text == ref_text


# ---- overload and SIGTERM (a second server: one running slot, one waiting) -----------------


@pytest.fixture(scope="module")
def small_server(gguf_path, tmp_path_factory):
    s = Server(gguf_path, tmp_path_factory.mktemp("small") / "server.log",
               "--max-num-seqs", "1", "--max-waiting-requests", "1", "--shutdown-timeout", "60")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_over_max_waiting_requests_gets_503_with_retry_after(small_server):
    client = small_server.client(api_key="unused")  # this server has no key: any is fine
    long = dict(model=MODEL, prompt=FRANCE, max_tokens=2000, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    running = client.completions.create(**long)
    waiting = None
    try:
        next(running)  # it runs: the one slot is taken
        waiting = client.completions.create(**long)  # queued: one waits
        r = httpx.post(f"{small_server.url}/v1/completions", json={"model": MODEL, "prompt": FRANCE})
        error = assert_openai_error(r, 503, "max_waiting_requests")
        assert error["type"] == "server_error" and int(r.headers["Retry-After"]) >= 1
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT)
        assert e.value.status_code == 503
        m = small_server.metrics()
        assert m["num_requests_running"] == 1 and m["num_requests_waiting"] == 1
    finally:
        for stream in (waiting, running):
            if stream is not None:
                stream.close()
    small_server.wait_idle()
    out = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, temperature=0)
    assert out.choices[0].text == " Paris."


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(small_server, llm):
    ref = llm.generate(FRANCE, greedy(40, ignore_eos=True))[0].outputs[0].text
    client = small_server.client(api_key="unused")
    stream = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=40, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    small_server.proc.send_signal(signal.SIGTERM)
    chunks += list(stream)  # the in-flight request still finishes
    assert "".join(c.choices[0].text for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"
    assert small_server.proc.wait(60) == 0, small_server.log_tail()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{small_server.url}/health")


def test_bench_serve_measures_the_server(server, tmp_path, capsys):
    """`ember bench serve` against this server: exact token totals, sane latencies."""
    from ember.server.cli import main

    out_json = tmp_path / "serve.json"
    before = server.metrics()
    main(["bench", "serve", "--base-url", server.url, "--api-key", KEY, "--num-prompts", "4",
          "--random-input-len", "8", "--random-output-len", "6", "--max-concurrency", "2", "--ignore-eos",
          "--seed", "3", "--output-json", str(out_json)])
    printed = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+4\n", printed)
    assert re.search(r"Total input tokens:\s+32\n", printed)
    assert re.search(r"Total generated tokens:\s+24\n", printed)
    result = json.loads(out_json.read_text())["results"]
    assert result["completed"] == 4 and result["failed"] == 0
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["p99_itl_ms"] >= result["median_itl_ms"] > 0
    after = server.wait_idle()
    # the server saw exactly these prompts and outputs
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 32
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 24


def test_bench_serve_shared_prefix_conversations_hit_the_prefix_cache(server, tmp_path, capsys):
    """2 conversations x 3 turns on one 40-token system prompt: every later turn carries
    its history, so it finds at least the system prompt's 2 full blocks cached."""
    from ember.server.cli import main

    out_json = tmp_path / "shared.json"
    before = server.metrics()
    main(["bench", "serve", "--base-url", server.url, "--api-key", KEY, "--dataset", "shared-prefix",
          "--num-prompts", "2", "--num-turns", "3", "--shared-prefix-len", "40", "--turn-input-len", "5",
          "--random-output-len", "4", "--ignore-eos", "--seed", "5", "--output-json", str(out_json)])
    assert re.search(r"Successful requests:\s+6\n", capsys.readouterr().out)
    result = json.loads(out_json.read_text())["results"]
    assert result["total_output_tokens"] == 6 * 4
    assert result["first_turn_mean_ttft_ms"] > 0 and result["later_turns_mean_ttft_ms"] > 0
    after = server.wait_idle()
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == result["total_input_tokens"]
    assert after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] == result["total_input_tokens"]
    assert after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= 4 * 32


def test_bench_serve_counts_failures(server, capsys):
    """A wrong API key: every request fails with its HTTP status, and the report says so."""
    from ember.server.cli import main

    main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--api-key", "wrong", "--num-prompts", "2",
          "--random-input-len", "4", "--random-output-len", "2"])
    printed = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+0\n", printed) and re.search(r"Failed requests:\s+2\n", printed)
    assert "HTTP 401" in printed
