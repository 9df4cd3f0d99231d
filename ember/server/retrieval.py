"""The retrieval routes of a pooling server (--runner pooling), in vLLM's shapes, on an
embedding model (a bi-encoder: each text pooled on its own, as /v1/embeddings does):

    POST /score, /v1/score          text_1 against text_2: the cosine similarity of their vectors
    POST /rerank, /v1/rerank        the query against each document, best first (Jina's and
    POST /v2/rerank                 Cohere's v1 shape; Cohere's v2 shape)
    POST /pooling                   each input's pooled vector
    POST /classify                  refused: it needs a sequence-classification head

A cross-encoder (a reranker that reads query and document together, bge-reranker) and
classification heads are not served yet: their models are refused at load."""

from __future__ import annotations

import math
import uuid
from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ember.outputs import RequestOutput
from ember.pooling import pooling_sampling_params
from ember.server import protocol as p
from ember.server.embeddings import EmbeddingRequest
from ember.server.limits import RequestLimits
from ember.server.serving import (
    ERRORS,
    APIError,
    ServerState,
    bad_request,
    engine_prompt,
    final_outputs,
    prepare,
    submit,
    until_disconnected,
)


class ScoreRequest(p._Strict):
    model: str | None = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """vLLM's pairing: one text_1 against each text_2, or text_1[i] against text_2[i]."""
        one = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        two = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not one or not two:
            raise p.InvalidRequest("text_1 and text_2 must each be a string or a non-empty list", "text_1")
        if len(one) == 1:
            return [(one[0], t) for t in two]
        if len(one) != len(two):
            raise p.InvalidRequest(f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or as many as "
                                   "text_2", "text_2")
        return list(zip(one, two))


class RerankRequest(p._Strict):
    model: str | None = None
    query: str
    documents: list[Union[str, dict[str, Any]]]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    max_tokens_per_doc: int | None = None  # Cohere's: refused unless unset
    user: str | None = None

    def texts(self) -> list[str]:
        if self.max_tokens_per_doc is not None:
            raise p.InvalidRequest("max_tokens_per_doc is not supported: give truncate_prompt_tokens", "max_tokens_per_doc")
        out = []
        for doc in self.documents:
            text = doc if isinstance(doc, str) else doc.get("text")
            if not isinstance(text, str):
                raise p.InvalidRequest("a document is a string or {'text': ...}", "documents")
            out.append(text)
        if not out:
            raise p.InvalidRequest("documents must be a non-empty list", "documents")
        return out


def checked(fn, *args):
    """fn(*args), its InvalidRequest a 400 (the route's own checks of the body)."""
    try:
        return fn(*args)
    except p.InvalidRequest as e:
        raise bad_request(e) from None


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def add_retrieval_routes(app: FastAPI, state: ServerState, limits: RequestLimits) -> None:
    async def vectors(raw: Request, texts: list[str], truncate: int | None) -> list[RequestOutput]:
        """Each distinct text's pooled output, in order of `texts`."""
        engine = state.ready_engine()
        distinct = list(dict.fromkeys(texts))
        if len(distinct) > limits.max_prompts:
            raise APIError(400, f"at most {limits.max_prompts} distinct texts in one request; got {len(distinct)}")
        request_id = f"score-{uuid.uuid4().hex}"

        def make():
            return [engine.inputs.make_request(f"{request_id}-{i}", engine_prompt(engine, text, truncate=truncate),
                                               pooling_sampling_params()) for i, text in enumerate(distinct)]

        streams = submit(engine, await prepare(engine, make))
        finals = await until_disconnected(raw, final_outputs(streams), streams)
        by_text = dict(zip(distinct, finals))
        return [by_text[t] for t in texts]

    def usage(outs: list[RequestOutput]) -> dict[str, int]:
        tokens = sum(len(o.prompt_token_ids) for o in {id(o): o for o in outs}.values())
        return {"prompt_tokens": tokens, "total_tokens": tokens}

    async def score(body: ScoreRequest, raw: Request) -> Response:
        model = state.check_model(body.model)
        pairs = checked(body.pairs)
        outs = await vectors(raw, [t for pair in pairs for t in pair], body.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": cosine(outs[2 * i].embedding, outs[2 * i + 1].embedding)}
                for i in range(len(pairs))]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                             "usage": usage(outs)})

    for path in ("/score", "/v1/score"):
        app.post(path, responses=ERRORS)(score)

    def rerank(v2: bool):
        async def route(body: RerankRequest, raw: Request) -> Response:
            model = state.check_model(body.model)
            docs = checked(body.texts)
            outs = await vectors(raw, [body.query, *docs], body.truncate_prompt_tokens)
            scores = [cosine(outs[0].embedding, out.embedding) for out in outs[1:]]
            order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or None]
            results = [{"index": i, "relevance_score": scores[i]} | (
                {"document": {"text": docs[i]}} if body.return_documents or not v2 else {}) for i in order]
            answer: dict[str, Any] = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                                      "usage": {"total_tokens": usage(outs)["total_tokens"]}}
            if v2:
                answer["meta"] = {"billed_units": {"search_units": 1}}
            return JSONResponse(answer)

        return route

    for path in ("/rerank", "/v1/rerank"):
        app.post(path, responses=ERRORS)(rerank(v2=False))
    app.post("/v2/rerank", responses=ERRORS)(rerank(v2=True))

    @app.post("/pooling", responses=ERRORS)
    async def pooling(body: EmbeddingRequest, raw: Request) -> Response:
        model = state.check_model(body.model)
        if body.dimensions is not None or body.encoding_format != "float":
            raise APIError(400, "/pooling takes input and model (use /v1/embeddings for dimensions or base64)")
        texts = checked(body.prompts, limits)
        if not all(isinstance(x, str) for x in texts):
            raise APIError(400, "/pooling takes text inputs here; send token ids to /v1/embeddings", param="input")
        outs = await vectors(raw, texts, None)
        data = [{"index": i, "object": "pooling", "data": out.embedding} for i, out in enumerate(outs)]
        return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                             "usage": usage(outs)})

    @app.post("/classify", responses=ERRORS)
    async def classify() -> Response:
        raise APIError(400, "/classify needs a sequence-classification model (a classification head), which ember "
                            "does not serve yet: this server pools an embedding model (/v1/embeddings, /score, "
                            "/rerank, /pooling)")
