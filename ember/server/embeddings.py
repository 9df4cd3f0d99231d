"""POST /v1/embeddings (OpenAI's shape) on a server started with --runner pooling, and the
refusals that keep each runner to its own routes: a generating server answers
/v1/embeddings with 400, a pooling server answers the text-generation routes with 400,
each saying which --runner the route needs.

Input: a string, a list of strings, a list of token ids or a list of lists of token ids;
each becomes one engine request that computes its prompt and ends with its pooled vector
(see ember/runner/pooler.py). `encoding_format` "base64" sends the little-endian float32
bytes, as OpenAI's client decodes them. `dimensions` is refused: a decoder LM's
embeddings have the model's hidden size, and cutting them is not the same vector."""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from ember.pooling import pooling_sampling_params
from ember.server import protocol as p
from ember.server.limits import RequestLimits
from ember.server.serving import ERRORS, APIError, ServerState, final_outputs, prepare, submit, until_disconnected

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate")
EMBEDDING_ROUTES = ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/pooling",
                    "/classify")  # retrieval.py's too


class EmbeddingRequest(p._Strict):
    model: str | None = None
    input: p.Bulk(Union[str, list[str], list[p.Int64], list[list[p.Int64]]])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted, as OpenAI does; nothing reads it

    def prompts(self, limits: RequestLimits) -> list[str | dict[str, Any]]:
        """One engine prompt per input: text, or {"prompt_token_ids": [...]}."""
        value = self.input
        if isinstance(value, str):
            prompts: list = [value]
        elif not isinstance(value, list) or not value:
            raise p.InvalidRequest("input must be a non-empty string, list of strings, token ids, or list of "
                                   "lists of token ids", "input")
        elif type(value[0]) is int:
            prompts = [{"prompt_token_ids": p.token_ids(value, "input")}]
        elif type(value[0]) is list:
            prompts = [{"prompt_token_ids": p.token_ids(ids, "input")} for ids in value]
        else:
            prompts = p.strings(value, "input")
        if len(prompts) > limits.max_prompts:
            raise p.InvalidRequest(f"at most {limits.max_prompts} inputs in one request; got {len(prompts)}",
                                   "input")
        return prompts


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def add_embeddings_route(app: FastAPI, state: ServerState, limits: RequestLimits) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"embd-{uuid.uuid4().hex}"

        def make():
            if body.dimensions is not None:
                raise p.InvalidRequest(f"dimensions is not supported: this model's embeddings have its hidden size "
                                       f"({engine.config.model_config.hidden_size}); leave dimensions out",
                                       "dimensions")
            return [engine.inputs.make_request(f"{request_id}-{i}", prompt, pooling_sampling_params())
                    for i, prompt in enumerate(body.prompts(limits))]

        streams = submit(engine, await prepare(engine, make))
        finals = await until_disconnected(raw, final_outputs(streams), streams)
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        data = [EmbeddingData(index=i, embedding=encode(out.embedding, body.encoding_format))
                for i, out in enumerate(finals)]
        response = EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                                  total_tokens=tokens))
        return JSONResponse(response.model_dump())


class RunnerRoutes:
    """ASGI middleware: 400 for the routes that the loaded engine does not serve (its runner;
    a classification model's /v1/embeddings). Until it is loaded every route answers for itself."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.refused: dict[str, str] | None = None

    def _refused(self) -> dict[str, str]:
        config = self.state.engine.config
        if config.runner == "generate":
            return dict.fromkeys(EMBEDDING_ROUTES, "this server generates text: {path} needs a server started "
                                 "with --runner pooling (or --task embed)")
        refused = dict.fromkeys(GENERATION_ROUTES, "this server computes embeddings (--runner pooling): {path} "
                                "needs a server started without --runner pooling")
        if config.model_config.classifier is not None:
            refused["/v1/embeddings"] = ("this server's model is a sequence classifier: {path} needs an embedding "
                                         "model (use /classify, /score or /rerank)")
        return refused

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if self.refused is None and self.state.engine is not None:
            self.refused = self._refused()
        if scope["type"] == "http" and self.refused and path in self.refused:
            await APIError(400, self.refused[path].format(path=path)).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
