"""What evaluation harnesses need from the server, end to end on a real `ember serve`
(float32, the default model): `echo` with the prompt tokens' logprobs, `max_tokens: 0`
(prompt scoring only), vLLM's `prompt_logprobs` on both routes, `GET /tokenizer_info`,
and lm-eval itself (`local-completions` with its remote tokenizer) on a tiny local task.

Every number is checked against the offline API on the same weights: the prompt logprobs
of `LLM.generate(..., SamplingParams(prompt_logprobs=N))`, the greedy text of
`LLM.generate`. After every test the engine holds no KV block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import FRANCE, KEY, MODEL, Server, assert_openai_error, post

from ember import SamplingParams

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LM_EVAL_DATA = Path(__file__).parent.parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(autouse=True)
def no_block_left(server):
    """After every test: nothing runs or waits, and no KV block is in use."""
    yield
    server.wait_idle()


def scored(llm, prompt, top: int):
    """The offline reference: the prompt scored with `top` alternatives per position."""
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=top))[0]


def assert_echo_equals(logprobs, ref, top: int) -> None:
    """A completion's echoed-prompt logprobs (OpenAI's legacy shape) against the offline ones."""
    ids, entries = ref.prompt_token_ids, ref.prompt_logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        assert logprobs.tokens[i] == entry[ids[i]].decoded_token
        assert logprobs.token_logprobs[i] == pytest.approx(entry[ids[i]].logprob, abs=1e-5)
        want = {lp.decoded_token: lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)
                if lp.rank <= top}
        assert list(logprobs.top_logprobs[i]) == list(want)
        assert list(logprobs.top_logprobs[i].values()) == pytest.approx(list(want.values()), abs=1e-5)


# ---- echo ----------------------------------------------------------------------------------


def test_echo_with_max_tokens_0_scores_the_prompt_as_offline(client, llm):
    ref = scored(llm, FRANCE, 2)
    out = client.completions.create(model=MODEL, prompt=FRANCE, echo=True, max_tokens=0, logprobs=2, temperature=0)
    choice = out.choices[0]
    assert choice.text == FRANCE and choice.finish_reason == "length"
    lp = choice.logprobs
    assert ref.prompt_token_ids == [504, 3575, 282, 4649, 314]
    assert lp.tokens == ["The", " capital", " of", " France", " is"]
    assert lp.text_offset == [0, 3, 11, 14, 21]
    assert_echo_equals(lp, ref, 2)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 0)


def test_echo_puts_the_prompt_before_the_completion(client, llm):
    ref = scored(llm, FRANCE, 1)
    gen = llm.generate(FRANCE, SamplingParams(temperature=0, max_tokens=4, logprobs=1))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=FRANCE, echo=True, max_tokens=4, logprobs=1, temperature=0)
    choice = out.choices[0]
    assert gen.text == " Paris.\n\n"
    assert choice.text == FRANCE + gen.text
    lp = choice.logprobs
    assert lp.tokens == ["The", " capital", " of", " France", " is"] + [
        d[t].decoded_token for d, t in zip(gen.logprobs, gen.token_ids)]
    assert len(lp.tokens) == 9 and lp.text_offset == [0, 3, 11, 14, 21, 24, 30, 31, 32]
    assert_echo_equals(lp, ref, 1)
    assert lp.token_logprobs[5:] == pytest.approx([d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)],
                                                  abs=1e-5)
    # without logprobs: the text only
    out = client.completions.create(model=MODEL, prompt=FRANCE, echo=True, max_tokens=4, temperature=0)
    assert out.choices[0].text == FRANCE + gen.text and out.choices[0].logprobs is None


def test_echo_of_token_id_and_batched_prompts(client, llm):
    tok = llm.get_tokenizer()
    texts = ["Once upon a time", "Roses are red,"]
    ids = [tok.encode(t) for t in texts]
    refs = [scored(llm, {"prompt_token_ids": i}, 1) for i in ids]
    for prompt in (ids, texts):  # a list of token-id lists, a list of strings
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, logprobs=1,
                                        temperature=0)
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == texts
        for choice, ref in zip(out.choices, refs):
            assert_echo_equals(choice.logprobs, ref, 1)
            assert choice.logprobs.text_offset == [sum(len(t) for t in choice.logprobs.tokens[:i])
                                                   for i in range(len(ref.prompt_token_ids))]
    out = client.completions.create(model=MODEL, prompt=ids[0], echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert out.choices[0].text == texts[0]
    assert out.choices[0].logprobs.tokens == ["Once", " upon", " a", " time"]
    assert out.choices[0].logprobs.text_offset == [0, 4, 9, 11]


def test_lm_eval_loglikelihood_requests_equal_offline_sums(client, llm):
    """What lm-eval's local-completions sends for a loglikelihood request: token-id prompts,
    echo, logprobs=1, temperature 0, a seed, max_tokens 1 (lm-eval 0.4) or 0 (older and
    other harnesses); it sums the continuation's logprobs and checks each is the top one."""
    tok = llm.get_tokenizer()
    context, continuation = "Question: What is the capital of France?\nAnswer:", " Paris"
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctxlen = len(tok.encode(context, add_special_tokens=False))
    ref = scored(llm, {"prompt_token_ids": whole}, 1)
    want = sum(ref.prompt_logprobs[i][whole[i]].logprob for i in range(ctxlen, len(whole)))
    greedy = all(ref.prompt_logprobs[i][whole[i]].rank == 1 for i in range(ctxlen, len(whole)))
    for max_tokens, end in ((1, -1), (0, None)):
        out = client.completions.create(model=MODEL, prompt=[whole], echo=True, max_tokens=max_tokens, logprobs=1,
                                         temperature=0, seed=1234)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(whole) + max_tokens
        assert sum(lp.token_logprobs[ctxlen:end]) == pytest.approx(want, abs=1e-4)
        is_greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[ctxlen:end],
                                                                 lp.top_logprobs[ctxlen:end]))
        assert is_greedy == greedy


# ---- prompt_logprobs (vLLM's field) ----------------------------------------------------------


def assert_prompt_logprobs_equal(got: list, ref_entries: list, ids: list[int], top: int) -> None:
    assert got[0] is None and len(got) == len(ids)
    for entry, ref, tid in zip(got[1:], ref_entries[1:], ids[1:]):
        kept = {t: lp for t, lp in ref.items() if t == tid or lp.rank <= top}
        assert sorted(int(k) for k in entry) == sorted(kept)
        for k, v in entry.items():
            r = kept[int(k)]
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert (v["rank"], v["decoded_token"]) == (r.rank, r.decoded_token)
            assert v["logprob"] == pytest.approx(r.logprob, abs=1e-5)


def test_prompt_logprobs_on_completions(server, llm):
    ref = scored(llm, FRANCE, 2)
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": 2, "temperature": 0,
                                              "prompt_logprobs": 2}).json()
    choice = body["choices"][0]
    assert choice["text"] == " Paris." and choice["logprobs"] is None
    assert_prompt_logprobs_equal(choice["prompt_logprobs"], ref.prompt_logprobs, ref.prompt_token_ids, 2)
    assert choice["prompt_logprobs"][1]["3575"]["decoded_token"] == " capital"
    # 0: the prompt token alone
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 0}).json()
    assert [list(e) if e else e for e in body["choices"][0]["prompt_logprobs"]] == \
        [None, ["3575"], ["282"], ["4649"], ["314"]]
    # not asked for: null
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": FRANCE, "max_tokens": 1}).json()
    assert body["choices"][0]["prompt_logprobs"] is None


def test_prompt_logprobs_on_chat(server, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))[0]
    body = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                   "temperature": 0, "prompt_logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == ref.outputs[0].text
    assert len(choice["prompt_logprobs"]) == body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert_prompt_logprobs_equal(choice["prompt_logprobs"], ref.prompt_logprobs, ref.prompt_token_ids, 1)


# ---- /tokenizer_info -------------------------------------------------------------------------


def test_tokenizer_info_is_the_default_models(server, llm):
    info = server_get(server, "/tokenizer_info")
    added = {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>", "3": "<repo_name>", "4": "<reponame>",
             "5": "<file_sep>", "6": "<filename>", "7": "<gh_stars>", "8": "<issue_start>", "9": "<issue_comment>",
             "10": "<issue_closed>", "11": "<jupyter_start>", "12": "<jupyter_text>", "13": "<jupyter_code>",
             "14": "<jupyter_output>", "15": "<jupyter_script>", "16": "<empty_output>"}
    assert info == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "add_bos_token": False, "model_max_length": 8192, "vocab_size": 49152,
        "added_tokens_decoder": added,
        "chat_template": llm.get_tokenizer().chat_template,
    }
    assert info["chat_template"].startswith("{% for message in messages %}")
    # what lm-eval's remote tokenizer does with it: the special tokens' ids through /tokenize
    ids = [post(server, "/tokenize", {"prompt": info[k], "add_special_tokens": False}).json()["tokens"]
           for k in ("eos_token", "bos_token")]
    assert ids == [[2], [1]]


def server_get(server: Server, path: str) -> dict:
    import httpx

    r = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# ---- refused with 400 -------------------------------------------------------------------------


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ["max_tokens", "echo"]),
    ("/v1/completions", {"prompt": "x", "echo": True, "stream": True}, "echo", ["stream"]),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ["stream"]),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     ["stream"]),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "n": 2}, "n", ["max_tokens=0"]),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", ["prompt_logprobs"]),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True}, "stream", ["not streamed"]),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "top_p": 0.5}, "top_p",
     ["does not apply to beam search"]),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.7}, "temperature",
     ["deterministic"]),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 11}, "n", ["n (the beam width)"]),
    ("/v1/completions", {"prompt": "x", "length_penalty": 0.5}, "length_penalty", ["use_beam_search true"]),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of", ["best_of 2 is not supported", "n=2"]),
    ("/v1/chat/completions", {"messages": CHAT, "use_beam_search": True}, "use_beam_search",
     ["use_beam_search is not supported"]),
    ("/v1/chat/completions", {"messages": CHAT, "best_of": 2}, "best_of", ["best_of 2 is not supported"]),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", ["unknown field"]),
    # without --trust-request-chat-template
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}, "chat_template",
     ["--trust-request-chat-template"]),
])
def test_refused_with_400_naming_the_field(server, route, body, param, words):
    error = assert_openai_error(post(server, route, {"model": MODEL, **body}), 400, *words)
    assert error["param"] == param


# ---- lm-eval itself --------------------------------------------------------------------------


def test_lm_eval_local_completions_equals_offline(server, llm, tmp_path):
    """lm-eval's local-completions with no tokenizer named: it finds /tokenizer_info and uses
    the server's tokenizer; its loglikelihoods and greedy answers equal the offline ones."""
    pytest.importorskip("lm_eval")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds"),
                        "OPENAI_API_KEY": KEY}
    args = f"base_url={server.url}/v1/completions,model={MODEL},auth_token={KEY}"
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--include_path", ".", "--tasks", "ember_tiny_mc,ember_tiny_gen", "--log_samples",
                          "--output_path", str(tmp_path / "out")],
                         cwd=LM_EVAL_DATA, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Auto-detected remote tokenizer support" in run.stderr + run.stdout

    def samples(task: str) -> list[dict]:
        (path,) = (tmp_path / "out").rglob(f"samples_{task}_*.jsonl")
        return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])

    tok = llm.get_tokenizer()
    mc = samples("ember_tiny_mc")
    assert len(mc) == 4
    for s in mc:
        context = f"Question: {s['doc']['question']}\nAnswer:"
        for choice, resp in zip(s["doc"]["choices"], s["resps"]):
            whole = tok.encode(f"{context} {choice}", add_special_tokens=False)
            ctxlen = len(tok.encode(context, add_special_tokens=False))
            ref = scored(llm, {"prompt_token_ids": whole}, 1)
            want = sum(ref.prompt_logprobs[i][whole[i]].logprob for i in range(ctxlen, len(whole)))
            greedy = all(ref.prompt_logprobs[i][whole[i]].rank == 1 for i in range(ctxlen, len(whole)))
            (ll, is_greedy), = resp
            assert float(ll) == pytest.approx(want, abs=1e-4), (s["doc"]["question"], choice)
            assert is_greedy == str(greedy)
        lls = [float(r[0][0]) for r in s["resps"]]
        assert s["acc"] == float(lls.index(max(lls)) == s["doc"]["answer"])
    gen = samples("ember_tiny_gen")
    assert len(gen) == 4
    for s in gen:
        context = tok.encode(f"Question: {s['doc']['question']}\nAnswer:", add_special_tokens=False)
        ref = llm.generate({"prompt_token_ids": context},
                           SamplingParams(temperature=0, max_tokens=8, stop=["\n"]))[0].outputs[0].text
        assert s["resps"] == [[ref]]


def test_beam_search_gives_the_offline_beams(client, llm):
    """vLLM's use_beam_search on /v1/completions: the n best sequences, as LLM.beam_search's."""
    from ember import BeamSearchParams

    want = llm.beam_search([FRANCE, "Once upon a time"], BeamSearchParams(beam_width=3, max_tokens=8))
    out = client.completions.create(model=MODEL, prompt=[FRANCE, "Once upon a time"], n=3, max_tokens=8,
                                    extra_body={"use_beam_search": True, "return_token_ids": True})
    prompt_lens = [len(llm.get_tokenizer().encode(t)) for t in (FRANCE, "Once upon a time")]
    expected = [(s.tokens[n:], s.text, s.finish_reason) for w, n in zip(want, prompt_lens) for s in w.sequences]
    got = [(c.model_extra["token_ids"], c.text, c.finish_reason) for c in out.choices]
    assert got == expected and len(got) == 6 and [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == sum(len(t) for t, _, _ in expected)
