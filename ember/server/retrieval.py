"""The retrieval routes of a pooling server (--runner pooling, or an encoder's default), in
vLLM's shapes:

    POST /score, /v1/score          text_1 against text_2
    POST /rerank, /v1/rerank        the query against each document, best first (Jina's and
    POST /v2/rerank                 Cohere's v1 shape; Cohere's v2 shape)
    POST /pooling                   each input's pooled vector (a classifier's: its logits)
    POST /classify                  each input's label probabilities (a classification model)

On an embedding model (a bi-encoder) a score is the cosine similarity of the two texts'
vectors, each pooled on its own as /v1/embeddings does; on a cross-encoder (a classification
model of one label: bge-reranker, ms-marco MiniLM) it is the probability its head gives the
two texts read together as one pair prompt."""

from __future__ import annotations

import time
import uuid
from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from ember.engine.async_engine import AsyncEngine
from ember.outputs import RequestOutput
from ember.pooling import cosine, label_probs, pooling_sampling_params, score_pairs
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
        try:
            return score_pairs(self.text_1, self.text_2)
        except ValueError as e:
            raise p.InvalidRequest(str(e), "text_2") from None


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


class ClassifyRequest(p._Strict):
    model: str | None = None
    input: Union[str, list[str]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None


def add_retrieval_routes(app: FastAPI, state: ServerState, limits: RequestLimits) -> None:
    async def pooled(raw: Request, items: list[Any], as_prompt) -> list[RequestOutput]:
        """Each distinct item's pooled output (as_prompt(engine, item) is its prompt), in order of `items`."""
        engine = state.ready_engine()
        distinct = list(dict.fromkeys(items))
        if len(distinct) > limits.max_prompts:
            raise APIError(400, f"at most {limits.max_prompts} distinct texts in one request; got {len(distinct)}")
        request_id = f"score-{uuid.uuid4().hex}"

        def make():
            return [engine.inputs.make_request(f"{request_id}-{i}", as_prompt(engine, item), pooling_sampling_params())
                    for i, item in enumerate(distinct)]

        streams = submit(engine, await prepare(engine, make))
        finals = await until_disconnected(raw, final_outputs(streams), streams)
        by_item = dict(zip(distinct, finals))
        return [by_item[item] for item in items]

    async def vectors(raw: Request, texts: list[str], truncate: int | None) -> list[RequestOutput]:
        return await pooled(raw, texts, lambda engine, text: engine_prompt(engine, text, truncate=truncate))

    def cross_encoder(engine: AsyncEngine) -> bool:
        mc = engine.config.model_config
        if mc.classifier is not None and mc.num_labels != 1:
            raise APIError(400, f"this server's model classifies into {mc.num_labels} labels; a score needs an "
                                "embedding model or a cross-encoder of one label: use /classify")
        return mc.classifier is not None

    async def scores(raw: Request, pairs: list[tuple[str, str]], truncate: int | None) -> tuple[list[float], int]:
        """Each pair's score and the prompt tokens read."""
        if cross_encoder(state.ready_engine()):
            if truncate is not None:
                raise APIError(400, "truncate_prompt_tokens does not apply to a cross-encoder's pair prompts: "
                                    "shorten the texts", param="truncate_prompt_tokens")
            outs = await pooled(raw, pairs, lambda engine, pair: engine.inputs.pair_prompt(*pair))
            return [label_probs(o.embedding)[0] for o in outs], usage(outs)
        outs = await vectors(raw, [t for pair in pairs for t in pair], truncate)
        return [cosine(outs[2 * i].embedding, outs[2 * i + 1].embedding) for i in range(len(pairs))], usage(outs)

    def usage(outs: list[RequestOutput]) -> int:
        return sum(len(o.prompt_token_ids) for o in {id(o): o for o in outs}.values())

    async def score(body: ScoreRequest, raw: Request) -> Response:
        model = state.check_model(body.model)
        pairs = checked(body.pairs)
        values, tokens = await scores(raw, pairs, body.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    for path in ("/score", "/v1/score"):
        app.post(path, responses=ERRORS)(score)

    def rerank(v2: bool):
        async def route(body: RerankRequest, raw: Request) -> Response:
            model = state.check_model(body.model)
            docs = checked(body.texts)
            values, tokens = await scores(raw, [(body.query, d) for d in docs], body.truncate_prompt_tokens)
            order = sorted(range(len(docs)), key=lambda i: -values[i])[:body.top_n or None]
            results = [{"index": i, "relevance_score": values[i]} | (
                {"document": {"text": docs[i]}} if body.return_documents or not v2 else {}) for i in order]
            answer: dict[str, Any] = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                                      "usage": {"total_tokens": tokens}}
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
        tokens = usage(outs)
        return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/classify", responses=ERRORS)
    async def classify(body: ClassifyRequest, raw: Request) -> Response:
        model = state.check_model(body.model)
        mc = state.ready_engine().config.model_config
        if mc.classifier is None:
            raise APIError(400, "/classify needs a sequence-classification model (a classification head); this "
                                "server pools an embedding model (/v1/embeddings, /score, /rerank, /pooling)")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not texts:
            raise APIError(400, "input must be a string or a non-empty list of strings", param="input")
        if len(texts) > limits.max_prompts:
            raise APIError(400, f"at most {limits.max_prompts} inputs in one request; got {len(texts)}", param="input")
        outs = await vectors(raw, texts, body.truncate_prompt_tokens)
        data = []
        for i, out in enumerate(outs):
            probs = label_probs(out.embedding)
            data.append({"index": i, "label": mc.label_names[max(range(len(probs)), key=probs.__getitem__)],
                         "probs": probs, "num_classes": len(probs)})
        tokens = usage(outs)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
