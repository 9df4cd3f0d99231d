"""/v1/embeddings with the official `openai` client against real `ember serve --runner
pooling` subprocesses on a tiny random Llama (a SentencePiece tokenizer beside it): float
and base64 answers equal the offline LLM.embed, for text and token-id inputs; the 400s
(dimensions, unknown fields, bad input, each runner's routes on the other); no KV block is
held afterwards."""

from __future__ import annotations

import base64
import shutil
import sys
from pathlib import Path

import numpy as np
import openai
import pytest
from servers import KEY, MODEL, Server, assert_openai_error, post

from ember import LLM

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_families import LLAMA, save_tiny_model  # noqa: E402

TEXTS = ["The capital of France is Paris.", "hello", "Once upon a time there was a tiny model that pooled its "
         "hidden states, one chunk after another, until the prompt ended."]
IDS = [[5, 17, 99, 3, 250, 41, 8, 77, 12, 19, 200, 6, 3], [7], list(range(3, 43))]
ENGINE = ["--block-size", "8", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, spm_tokenizer_dir) -> Path:
    path = tmp_path_factory.mktemp("tiny-embed")
    save_tiny_model(LLAMA | {"vocab_size": 512}, path)  # the SentencePiece tokenizer's vocabulary
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(spm_tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    """(a pooling server, a generating server), started side by side."""
    logs = tmp_path_factory.mktemp("embed-servers")
    pooling = Server(tiny_dir, logs / "pooling.log", "--runner", "pooling", "--api-key", KEY, *ENGINE)
    generating = Server(tiny_dir, logs / "generate.log", "--api-key", KEY, *ENGINE)
    try:
        pooling.wait_ready()
        generating.wait_ready()
        yield pooling, generating
    finally:
        codes = pooling.stop(), generating.stop()
    assert codes == (0, 0), pooling.log_tail() + generating.log_tail()


@pytest.fixture(scope="module")
def offline(tiny_dir) -> LLM:
    return LLM(str(tiny_dir), runner="pooling", dtype="float32", block_size=8, num_kv_blocks=64,
               max_num_batched_tokens=16, max_model_len=128)


def vectors(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float32)


def test_float_and_base64_equal_the_offline_embeddings(servers, offline):
    server, _ = servers
    client = server.client()
    want = vectors(offline.embed(TEXTS))
    as_float = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in as_float.data], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert [d.index for d in as_float.data] == [0, 1, 2] and as_float.model == MODEL
    tokens = sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS))
    assert (as_float.usage.prompt_tokens, as_float.usage.total_tokens) == (tokens, tokens)
    as_base64 = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in as_base64.data])
    np.testing.assert_allclose(decoded, want, atol=1e-6, rtol=0)
    by_default = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks for base64 and decodes it
    np.testing.assert_allclose(np.array(by_default.data[0].embedding, dtype=np.float32), want[0], atol=1e-6, rtol=0)
    assert np.allclose(np.linalg.norm(want, axis=1), 1, atol=1e-5)  # last token, normalized
    server.wait_idle()


def test_token_id_inputs_equal_the_offline_embeddings(servers, offline):
    server, _ = servers
    client = server.client()
    want = vectors(offline.embed([{"prompt_token_ids": ids} for ids in IDS]))
    many = client.embeddings.create(model=MODEL, input=IDS, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in many.data], dtype=np.float32), want, atol=1e-6, rtol=0)
    assert many.usage.prompt_tokens == sum(map(len, IDS))
    one = client.embeddings.create(model=MODEL, input=IDS[2], encoding_format="float", user="someone")
    np.testing.assert_allclose(np.array(one.data[0].embedding, dtype=np.float32), want[2], atol=1e-6, rtol=0)
    server.wait_idle()


def test_the_response_has_openais_shape(servers):
    server, _ = servers
    r = post(server, "/v1/embeddings", {"model": MODEL, "input": [1, 2, 3], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["object", "data", "model", "usage"]
    assert (body["object"], body["model"], body["usage"]) == ("list", MODEL, {"prompt_tokens": 3, "total_tokens": 3})
    assert [sorted(d) for d in body["data"]] == [["embedding", "index", "object"]]
    assert (body["data"][0]["object"], body["data"][0]["index"]) == ("embedding", 0)
    assert len(base64.b64decode(body["data"][0]["embedding"])) == 4 * LLAMA["hidden_size"]


@pytest.mark.parametrize("body, words, param", [
    ({"input": "hi", "dimensions": 8}, ["dimensions is not supported", "hidden size (64)"], "dimensions"),
    ({"input": "hi", "truncate_prompt_tokens": 4}, ["truncate_prompt_tokens"], None),
    ({"input": []}, ["input must be a non-empty string"], "input"),
    ({"input": [[1, 2], [3, 9999]]}, ["prompt token ids must be integers in [0, 512)"], None),
    ({"input": "hi", "encoding_format": "int8"}, ["encoding_format"], None),
])
def test_bad_embedding_requests_get_400(servers, body, words, param):
    server, _ = servers
    error = assert_openai_error(post(server, "/v1/embeddings", {"model": MODEL} | body), 400, *words)
    if param is not None:
        assert error["param"] == param
    server.wait_idle()


def test_each_runner_refuses_the_others_routes(servers):
    pooling, generating = servers
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        assert_openai_error(post(pooling, path, {"model": MODEL, "prompt": "hi"}), 400,
                            f"this server computes embeddings (--runner pooling): {path} needs a server "
                            "started without --runner pooling")
    assert_openai_error(post(generating, "/v1/embeddings", {"model": MODEL, "input": "hi"}), 400,
                        "this server generates text: /v1/embeddings needs a server started with --runner "
                        "pooling (or --task embed)")
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        generating.client().embeddings.create(model=MODEL, input="hi")
    r = post(generating, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text  # the generating server still generates
    unauthorized = post(pooling, "/v1/completions", {"model": MODEL, "prompt": "hi"},
                         headers={"Authorization": "Bearer wrong"})
    assert unauthorized.status_code == 401  # the key is checked first


# ---- the retrieval routes (server/retrieval.py) --------------------------------------------------


def cosines(offline, query: str, texts: list[str]) -> list[float]:
    q, docs = vectors(offline.embed([query])), vectors(offline.embed(texts))
    return [float(x) for x in (docs @ q[0]) / (np.linalg.norm(docs, axis=1) * np.linalg.norm(q[0]))]


def test_score_is_the_cosine_of_the_offline_embeddings(servers, offline):
    server, _ = servers
    want = cosines(offline, TEXTS[0], TEXTS)
    for path in ("/score", "/v1/score"):
        r = post(server, path, {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS})
        assert r.status_code == 200, r.text
        got = r.json()
        assert [d["index"] for d in got["data"]] == [0, 1, 2] and {d["object"] for d in got["data"]} == {"score"}
        np.testing.assert_allclose([d["score"] for d in got["data"]], want, atol=1e-5, rtol=0)
        assert got["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    pairs = post(server, "/score", {"model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairs], [cosines(offline, TEXTS[0], [TEXTS[1]])[0],
                                                             cosines(offline, TEXTS[1], [TEXTS[2]])[0]], atol=1e-5)
    assert_openai_error(post(server, "/score", {"model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS}), 400,
                        "text_1 has 2 texts and text_2 3")


def test_rerank_orders_the_documents_by_their_score(servers, offline):
    server, _ = servers
    query, docs = "Where is Paris?", TEXTS
    want = cosines(offline, query, docs)
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank"):
        got = post(server, path, {"model": MODEL, "query": query, "documents": docs, "top_n": 2}).json()
        assert [r["index"] for r in got["results"]] == order[:2]
        np.testing.assert_allclose([r["relevance_score"] for r in got["results"]], [want[i] for i in order[:2]],
                                   atol=1e-5)
        assert got["results"][0]["document"] == {"text": docs[order[0]]} and got["usage"]["total_tokens"] > 0
    v2 = post(server, "/v2/rerank", {"model": MODEL, "query": query, "documents": docs,
                                      "return_documents": False}).json()
    assert [r["index"] for r in v2["results"]] == order and "document" not in v2["results"][0]


def test_pooling_gives_the_vectors_and_classify_says_what_it_needs(servers, offline):
    server, generating = servers
    got = post(server, "/pooling", {"model": MODEL, "input": TEXTS[:2]}).json()
    np.testing.assert_allclose([d["data"] for d in got["data"]], vectors(offline.embed(TEXTS[:2])), atol=1e-6)
    assert [d["object"] for d in got["data"]] == ["pooling", "pooling"]
    assert_openai_error(post(server, "/classify", {"model": MODEL, "input": "hi"}), 400,
                        "needs a sequence-classification model")
    for path in ("/score", "/rerank", "/v2/rerank", "/pooling"):  # the generating server has no pooled vectors
        assert_openai_error(post(generating, path, {"model": MODEL}), 400, "needs a server started with --runner pooling")
