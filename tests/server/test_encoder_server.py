"""Encoder models behind real `ember serve` subprocesses (no --runner flag: an encoder's
"auto" is pooling), on tiny random checkpoints saved by HF transformers: a BERT
cross-encoder's /score, /rerank and /v2/rerank equal sentence-transformers' CrossEncoder, a
three-label classifier's /classify equals transformers' softmax with its label names, an
XLM-RoBERTa embedding model's /v1/embeddings (through the `openai` client) equals
sentence-transformers' encode; each model's wrong routes get 400; nothing is left running."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from servers import KEY, MODEL, Server, assert_openai_error, post

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from encoder_models import PAIRS, TEXTS, save_bert, save_xlm_roberta  # noqa: E402

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"rerank", "classify", "embed"}: (server, checkpoint directory), started side by side."""
    root = tmp_path_factory.mktemp("encoders")
    paths = {"rerank": save_bert(root / "rerank", head="classify", num_labels=1, seed=2),
             "classify": save_bert(root / "classify", head="classify", num_labels=3, seed=1),
             "embed": save_xlm_roberta(root / "embed")}
    started = {kind: Server(path, root / f"{kind}.log", "--api-key", KEY, "--max-model-len", "64")
               for kind, path in paths.items()}
    try:
        for server in started.values():
            server.wait_ready()
        yield {kind: (started[kind], paths[kind]) for kind in paths}
    finally:
        codes = [s.stop() for s in started.values()]
    assert codes == [0, 0, 0], "".join(s.log_tail() for s in started.values())


def test_a_cross_encoder_scores_and_reranks_as_sentence_transformers(servers):
    server, path = servers["rerank"]
    cross = st.CrossEncoder(str(path), device="cpu")
    queries, docs = map(list, zip(*PAIRS))
    got = post(server, "/v1/score", {"model": MODEL, "text_1": queries, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in got["data"]], cross.predict(PAIRS), atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert got["usage"]["prompt_tokens"] == sum(len(tok(q, d)["input_ids"]) for q, d in PAIRS)
    query = queries[0]
    want = cross.predict([(query, d) for d in docs])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = post(server, route, {"model": MODEL, "query": query, "documents": docs, "top_n": 3}).json()
        assert [r["index"] for r in got["results"]] == list(np.argsort(-want)[:3]), route
        np.testing.assert_allclose([r["relevance_score"] for r in got["results"]], np.sort(want)[::-1][:3],
                                   atol=1e-4)
    one = post(server, "/classify", {"model": MODEL, "input": [f"{query} {docs[0]}"]}).json()["data"][0]
    assert one["label"] == "LABEL_0" and one["num_classes"] == 1 and 0 < one["probs"][0] < 1
    assert_openai_error(post(server, "/score", {"model": MODEL, "text_1": "q", "text_2": "d",
                                                "truncate_prompt_tokens": 8}),
                        400, "truncate_prompt_tokens does not apply to a cross-encoder's pair prompts")
    assert_openai_error(post(server, "/v1/embeddings", {"model": MODEL, "input": "hi"}), 400,
                        "this server's model is a sequence classifier: /v1/embeddings needs an embedding model")
    assert_openai_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}), 400,
                        "this server computes embeddings (--runner pooling)")
    server.wait_idle()


def test_classify_gives_the_labels_and_their_probabilities(servers):
    server, path = servers["classify"]
    got = post(server, "/classify", {"model": MODEL, "input": TEXTS[:3]}).json()
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        want = [hf(**tok(t, return_tensors="pt")).logits[0].softmax(-1) for t in TEXTS[:3]]
    assert [d["index"] for d in got["data"]] == [0, 1, 2] and got["object"] == "list" and got["model"] == MODEL
    for item, probs in zip(got["data"], want):
        np.testing.assert_allclose(item["probs"], probs.numpy(), atol=1e-5)
        assert item["label"] == ("negative", "neutral", "positive")[int(probs.argmax())]
        assert item["num_classes"] == 3
    assert got["usage"]["prompt_tokens"] == sum(len(tok(t)["input_ids"]) for t in TEXTS[:3])
    assert_openai_error(post(server, "/score", {"model": MODEL, "text_1": "q", "text_2": "d"}), 400,
                        "classifies into 3 labels; a score needs an embedding model or a cross-encoder of one label")
    assert_openai_error(post(server, "/classify", {"model": MODEL, "input": []}), 400, "non-empty list")
    server.wait_idle()


def test_an_encoder_embeds_as_sentence_transformers_through_the_openai_client(servers):
    server, path = servers["embed"]
    got = server.client().embeddings.create(model=MODEL, input=TEXTS)
    want = st.SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-4)
    score = post(server, "/score", {"model": MODEL, "text_1": PAIRS[0][0], "text_2": [PAIRS[0][1]]}).json()
    a, b = st.SentenceTransformer(str(path), device="cpu").encode(list(PAIRS[0]))
    assert score["data"][0]["score"] == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=1e-4)
    assert_openai_error(post(server, "/classify", {"model": MODEL, "input": "hi"}), 400,
                        "needs a sequence-classification model")
    server.wait_idle()
