"""The OpenAI-compatible HTTP server: FastAPI routes in front of one AsyncEngine.

    POST /v1/chat/completions   POST /v1/completions     (stream or not)
    GET  /v1/models             GET  /health (503 until the model is loaded)
    POST /tokenize              POST /detokenize         GET /tokenizer_info
    GET  /version               GET  /metrics
    POST /v1/embeddings         (--runner pooling: embeddings.py)
    POST /v1/responses          (run as a chat completion: responses.py)

Every request is validated here (strict pydantic shapes and ranges, RequestLimits,
SamplingParams, chat template, tokenize, prompt length): bad input is refused with 400
before it reaches the engine thread. Work that grows with the input (templates,
tokenizing, grammar checks) runs on the engine's input pool, never on the event loop, and
bodies over `max_body_bytes` are refused with 413 before they are parsed, so /health
answers at once whatever one client sends. Errors take OpenAI's shape:
{"error": {"message", "type", "param", "code"}}; a 500 never carries internal text.

`--api-key` guards every route but /health, /version, the OpenAPI docs and (with
`--metrics-public`) /metrics. The model loads on a background thread after the server
starts listening, so /health can say 503 while it loads. `run_server()` is what `ember
serve` calls; see it for shutdown (drain, then fail what is left with an error) and
exit codes.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import ember
from ember.config import EngineConfig
from ember.engine.async_engine import (AsyncEngine, EngineDeadError, EngineOverloadedError, EngineStoppedError,
                                       RequestFailedError, RequestStream)
from ember.engine.stats import LoggingStatLogger
from ember.outputs import CompletionOutput, Logprob, RequestOutput
from ember.request import Request as EngineRequest
from ember.sampling_params import SamplingParams
from ember.server import protocol as p
from ember.server import scoring
from ember.server.metrics import ServerMetrics
from ember.server.responses import ResponseBuilder, ResponsesRequest
from ember.server.tool_calls import ToolPlan, checked_tools, plan_tools

logger = logging.getLogger("ember.server")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait


@dataclass(frozen=True)
class CORSOptions:
    """Starlette's CORSMiddleware settings (vLLM's flag names: --allowed-origins, ...)."""

    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig  # resolved
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    limits: p.RequestLimits = p.RequestLimits()
    metrics_public: bool = False  # /metrics without the API key
    cors: CORSOptions | None = None  # None: no CORS headers (browsers refuse other origins)
    log_requests: bool = False  # each request's id, prompt length and sampling parameters at INFO
    tool_call_parser: str | None = None  # reads tool_choice "auto" outputs (--enable-auto-tool-choice)
    reasoning_parser: str | None = None  # splits off <think> reasoning (--reasoning-parser)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code))
        return _ErrorJSON(body.model_dump(), status_code=self.status, headers=self.headers)


class _ErrorJSON(JSONResponse):
    """ASCII JSON: an error message may quote input that is not valid UTF-8 text."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


def bad_request(e: Exception) -> APIError:
    return APIError(400, str(e), param=getattr(e, "param", None))


def input_error(e: Exception) -> APIError:
    """What a client is told when its input raised while being prepared: 400 for anything
    its input can cause, 500 with a generic message (logged) otherwise."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, jinja2.TemplateError)) and not isinstance(e, UnicodeError):
        return bad_request(e)
    if isinstance(e, UnicodeError):
        return APIError(400, "invalid request: text must be valid Unicode")
    if isinstance(e, RecursionError):
        return APIError(400, "invalid request: the input nests too deeply")
    if isinstance(e, (TypeError, KeyError, IndexError, AttributeError)):
        logger.warning("a request's input raised %s: %s", type(e).__name__, e)
        return APIError(400, f"invalid request: the input could not be processed ({type(e).__name__})")
    logger.error("preparing a request failed", exc_info=e)
    return APIError(500, "internal error while preparing the request (see the server log)", "server_error")


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine | None = None
    load_error: BaseException | None = None
    stat_loggers: list = field(default_factory=list)  # handed to the engine it loads
    on_fatal: Callable[[], None] | None = None  # the engine could not load or died: stop the server
    started: float = field(default_factory=time.time)
    stopping: bool = False

    async def drain(self) -> None:
        """Stop taking requests; let those in flight finish within the shutdown timeout, then
        fail the rest (idempotent)."""
        self.stopping = True
        if self.engine is not None:
            await self.engine.shutdown(self.config.shutdown_timeout)

    def engine_died(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread, when its loop dies: stop the server (it exits non-zero)."""
        if self.on_fatal is not None:
            try:
                loop.call_soon_threadsafe(self.on_fatal)
            except RuntimeError:  # the event loop is closed already
                pass

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", "server_error")
            raise APIError(503, "the model is still loading: retry shortly", "server_error",
                           code="loading", headers={"Retry-After": str(RETRY_AFTER_S)})
        if self.engine.error is not None:
            raise APIError(503, "the engine loop died: the server is going down (see its log)", "server_error")
        if not self.engine.is_running:
            raise APIError(503, "the server is shutting down", "server_error")
        return self.engine

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.config.served_model_names:
            return self.config.model_name
        raise APIError(404, f"The model `{model}` does not exist. This server serves: "
                       f"{', '.join(self.config.served_model_names)}", param="model", code="model_not_found")

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Build the engine (runs on its own thread)."""
        try:
            engine = AsyncEngine(self.config.engine, self.config.max_waiting_requests, self.stat_loggers,
                                 on_dead=lambda e: self.engine_died(loop), log_requests=self.config.log_requests)
            engine.core.structured.warm_up()
        except BaseException as e:
            logger.exception("the model failed to load")
            self.load_error = e
            if self.on_fatal is not None:
                loop.call_soon_threadsafe(self.on_fatal)
            return
        self.engine = engine
        if self.stopping:  # SIGTERM came while it loaded
            engine.stop()
            return
        # what is alive now (the model, torch, the app) lives as long as the server: out of the
        # garbage collector's sight, a full collection while a request parses takes ms, not 100
        gc.freeze()
        logger.info("ready: %s (%d KV blocks of %d tokens, max_model_len %d)", self.config.model_name,
                    engine.core.block_pool.num_blocks, engine.core.config.block_size, engine.core.config.max_model_len)


# -- the app ---------------------------------------------------------------------------------


def build_app(config: ServerConfig, engine: AsyncEngine | None = None) -> FastAPI:
    """The FastAPI app. With `engine` given it serves that one (already loaded); otherwise
    it loads one from `config.engine` in the background once the server starts."""
    state = ServerState(config, engine)
    metrics = ServerMetrics(config.model_name, lambda: state.engine.current_stats() if state.engine else None)
    state.stat_loggers = [LoggingStatLogger(), metrics.stat_logger]
    limits = config.limits
    if engine is not None:
        engine.stat_loggers.extend(state.stat_loggers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        if state.engine is None:
            threading.Thread(target=state.load, args=(loop,), name="ember-load", daemon=True).start()
        else:
            state.engine.on_dead = lambda e: state.engine_died(loop)
        yield
        await state.drain()

    app = FastAPI(title="ember", version=ember.__version__, lifespan=lifespan)
    app.state.ember = state
    from ember.server.embeddings import RunnerRoutes, add_embeddings_route

    app.add_middleware(RunnerRoutes, runner=config.engine.runner)
    app.add_middleware(_BodyMiddleware, max_bytes=limits.max_body_bytes)
    if config.api_key:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(_APIKeyMiddleware, api_key=config.api_key,
                           open_paths=_OPEN_PATHS | ({"/metrics"} if config.metrics_public else set()))
    if config.cors is not None:  # outermost: a preflight carries no API key
        cors = config.cors
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    _add_error_handlers(app)
    add_embeddings_route(app, state, limits)

    @app.get("/health", response_class=Response, responses={200: {"description": "Ready (an empty body)"}, **_ERRORS})
    async def health() -> Response:
        state.ready_engine()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ember.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_ERRORS)
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", response_model=p.ModelList, responses=_ERRORS)
    async def models() -> dict[str, Any]:
        cards = [p.ModelCard(id=name, root=name, max_model_len=config.engine.max_model_len,
                             created=int(state.started)) for name in config.served_model_names]
        return p.ModelList(data=cards).model_dump()

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: p.TokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)

        def ids() -> list[int]:
            if (body.prompt is None) == (body.messages is None):
                raise p.InvalidRequest("give exactly one of prompt and messages", "prompt")
            if body.messages is not None:
                return engine.inputs.chat_prompt(p.conversation(body.messages), body.add_generation_prompt,
                                                 tools=checked_tools(body.tools))["prompt_token_ids"]
            if body.tools is not None:
                raise p.InvalidRequest("tools are rendered with messages: give messages, not prompt", "tools")
            return engine.inputs.encode(body.prompt, add_special_tokens=body.add_special_tokens)

        tokens = await _prepare(engine, ids)
        return {"count": len(tokens), "max_model_len": config.engine.max_model_len, "tokens": tokens}

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: p.DetokenizeRequest) -> dict[str, Any]:
        engine = state.ready_engine()
        state.check_model(body.model)

        def text() -> str:
            tokens = p.token_ids(body.tokens, "tokens")
            if len(tokens) > config.engine.max_model_len:  # one decode call holds the interpreter lock
                raise p.InvalidRequest(f"at most max_model_len ({config.engine.max_model_len}) tokens; got "
                                       f"{len(tokens)}", "tokens")
            vocab = engine.inputs.vocab_size
            if tokens and max(tokens) >= vocab:
                raise p.InvalidRequest(f"token ids must be in [0, {vocab}); got {max(tokens)}", "tokens")
            return engine.inputs.require_tokenizer().decode(tokens)

        return {"prompt": await _prepare(engine, text)}

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def tokenizer_info() -> dict[str, Any]:
        engine = state.ready_engine()
        return await _prepare(engine, lambda: scoring.tokenizer_info(engine.inputs.require_tokenizer(),
                                                                     config.engine.max_model_len))

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=_STREAMED_ERRORS)
    async def chat_completions(body: p.ChatCompletionRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def make() -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
            return _chat_requests(engine, config, body, request_id)

        params, requests, tools = await _prepare(engine, make)
        streams = _submit(engine, requests)
        if body.stream:
            chunks = _chat_chunks(streams[0], request_id, model, params, body.include_usage, tools)
            return _sse(_sse_lines(chunks), streams)
        final = (await _until_disconnected(raw, _final_outputs(streams), streams))[0]
        return JSONResponse(_chat_answer(final, params, tools, body, request_id, model).model_dump())

    @app.post("/v1/responses", responses=_STREAMED_ERRORS)
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API, run as the chat completion it translates to (responses.py)."""
        engine = state.ready_engine()
        model = state.check_model(body.model)
        answer = ResponseBuilder(body, model)

        def make() -> tuple[p.ChatCompletionRequest, SamplingParams, list[EngineRequest], ToolPlan]:
            chat = p.ChatCompletionRequest.model_validate(body.chat_request())
            return chat, *_chat_requests(engine, config, chat, answer.id)

        chat, params, requests, tools = await _prepare(engine, make)
        streams = _submit(engine, requests)
        if body.stream:
            chunks = _chat_chunks(streams[0], answer.id, model, params, True, tools)
            return _sse(answer.events(chunk.model_dump() async for chunk in chunks), streams)
        final = (await _until_disconnected(raw, _final_outputs(streams), streams))[0]
        return JSONResponse(answer.from_chat(_chat_answer(final, params, tools, chat, answer.id, model).model_dump()))

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=_STREAMED_ERRORS)
    async def completions(body: p.CompletionRequest, raw: Request) -> Response:
        engine = state.ready_engine()
        model = state.check_model(body.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"

        def make() -> tuple[SamplingParams, list[EngineRequest]]:
            params = body.to_sampling_params(limits, engine.config.sampling_defaults)
            if body.echo:
                engine.inputs.require_tokenizer()  # to write token-id prompts back as text
            return params, [engine.inputs.make_request(f"{request_id}-{i}", prompt, params, body.priority)
                            for i, prompt in enumerate(body.prompts(limits))]

        params, requests = await _prepare(engine, make)
        streams = _submit(engine, requests)
        if body.stream:
            return _sse(_completion_chunks(streams, request_id, model, params, body.include_usage), streams)
        finals = await _until_disconnected(raw, _final_outputs(streams), streams)
        choices = [p.CompletionChoice(index=i * params.n + c.index, text=c.text,
                                      logprobs=_completion_logprobs(c.logprobs, params, 0)
                                      if c.logprobs is not None else None,
                                      finish_reason=_finish_reason(c), stop_reason=c.stop_reason,
                                      prompt_logprobs=scoring.prompt_logprobs(final, body.prompt_logprobs))
                   for i, final in enumerate(finals) for c in _all_samples(final, params)]
        if body.echo:
            for choice in choices:
                scoring.echo(choice, finals[choice.index // params.n], body.logprobs, engine.inputs.tokenizer)
        response = p.CompletionResponse(id=request_id, model=model, choices=choices, usage=_usage(finals))
        return JSONResponse(response.model_dump())

    _document_errors(app)
    return app


async def _prepare(engine: AsyncEngine, fn, *args):
    """fn(*args) on the engine's input pool; what the input makes it raise becomes its status."""
    try:
        return await engine.prepare(fn, *args)
    except Exception as e:
        raise input_error(e) from None


def _submit(engine: AsyncEngine, requests: list[EngineRequest]) -> list[RequestStream]:
    """Queue every request of one HTTP request, or none."""
    streams: list[RequestStream] = []
    try:
        for req in requests:
            streams.append(engine.submit(req))
    except BaseException as e:
        for stream in streams:
            stream.abort()
        if isinstance(e, EngineOverloadedError):
            raise APIError(503, str(e), "server_error", code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if isinstance(e, EngineStoppedError):
            raise _engine_error(e) from None
        if isinstance(e, ValueError):
            raise bad_request(e) from None
        raise
    return streams


def _chat_requests(engine: AsyncEngine, config: ServerConfig, body: p.ChatCompletionRequest,
                   request_id: str) -> tuple[SamplingParams, list[EngineRequest], ToolPlan]:
    """A chat request's sampling parameters, its engine request and its tool plan (on the
    input pool: the template and the tools' grammar grow with the input)."""
    tools = plan_tools(body, config.tool_call_parser, config.reasoning_parser)
    params = tools.sampling_params(body.to_sampling_params(config.limits, engine.config.sampling_defaults))
    prompt = engine.inputs.chat_prompt(body.conversation(), body.add_generation_prompt, tools=tools.tools,
                                       **body.template_kwargs())
    params, tools = tools.gate_reasoning(params, prompt["prompt"], engine.inputs.require_tokenizer())
    return params, [engine.inputs.make_request(request_id, prompt, params, body.priority)], tools


def _chat_answer(final: RequestOutput, params: SamplingParams, tools: ToolPlan, body: p.ChatCompletionRequest,
                 request_id: str, model: str) -> p.ChatCompletionResponse:
    choices = []
    for c in _all_samples(final, params):
        message, finish_reason = tools.message(c)
        choices.append(p.ChatCompletionChoice(
            index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
            logprobs=_chat_logprobs(c.logprobs, params) if c.logprobs is not None else None,
            prompt_logprobs=scoring.prompt_logprobs(final, body.prompt_logprobs)))
    return p.ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=_usage([final]))


# -- middleware and errors -------------------------------------------------------------------

# open without the API key: liveness, the version, and the API's own description
_OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class _APIKeyMiddleware:
    """401 without `Authorization: Bearer <key>` on every route but `open_paths` (llama-server's
    rule: anything that takes input or tells about the served model needs the key)."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] | set[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyMiddleware:
    """413 for a request body over `max_bytes`, before anything parses it (the body is read
    here, by Content-Length or as it streams in, and handed on whole); 400 for a body whose
    text is not valid Unicode."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes "
                                  "(ember serve --max-request-body-bytes)", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large.response()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if p.has_lone_surrogate(body):
            await APIError(400, "invalid request: text must be valid Unicode: found a lone surrogate "
                                "(\\ud800-\\udfff)").response()(scope, receive, send)
            return
        whole = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            ctx = next(err for err in errors if err.get("type") == "json_invalid").get("ctx", {})
            return APIError(400, f"malformed JSON in the request body: {ctx.get('error', 'cannot parse it')}",
                            code="invalid_json").response()
        parts, param = [], None
        for err in errors[:8]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[0] if loc else None)
            message = str(err.get("msg")).removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                message = "unknown field: ember does not support it"
            parts.append(f"{'.'.join(loc)[:200] or 'body'}: {message}")
        return APIError(400, "invalid request: " + "; ".join(parts), param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        try:
            phrase = HTTPStatus(e.status_code).phrase
        except ValueError:
            phrase = "error"
        message = e.detail if isinstance(e.detail, str) else phrase
        return APIError(e.status_code, f"{message}: {request.method} {request.url.path[:200]}", kind).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        if isinstance(e, (RecursionError, UnicodeError)):  # from one request's input
            return input_error(e).response()
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, "internal server error (see the server log)", "server_error").response()


_ERROR_RESPONSE = {"model": p.ErrorResponse}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request", **_ERROR_RESPONSE},
    401: {"description": "Invalid or missing API key (with --api-key)", **_ERROR_RESPONSE},
    404: {"description": "Unknown model or route", **_ERROR_RESPONSE},
    413: {"description": "Request body too large", **_ERROR_RESPONSE},
    500: {"description": "Internal error", **_ERROR_RESPONSE},
    503: {"description": "Loading, overloaded or shutting down", **_ERROR_RESPONSE},
}
_STREAMED_ERRORS = {**_ERRORS, 200: {"description": "The response, or with stream=true server-sent events of "
                                                    "chunks", "content": {"text/event-stream": {}}}}


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI schema says what the server does: 400 for invalid input (FastAPI would
    document its own 422, which this server never sends)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
            schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# -- collecting outputs ----------------------------------------------------------------------


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def _engine_error(e: Exception) -> APIError:
    """The error a request's client gets when the engine ends it without a result."""
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed while generating: {e}", "server_error")
    if isinstance(e, EngineDeadError):  # its text names the exception: that stays in the log
        return APIError(503, "the engine loop died: the server is going down (see its log)", "server_error")
    return APIError(503, str(e), "server_error")


async def _final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in _merge(streams):
            finals[i] = out
    except (EngineStoppedError, RequestFailedError) as e:
        raise _engine_error(e) from None
    missing = [s.request_id for s, f in zip(streams, finals) if f is None]
    if missing:  # aborted before its first token (shutdown)
        raise APIError(503, "the request was aborted: the server is shutting down", "server_error")
    return finals


async def _until_disconnected(raw: Request, work: Awaitable, streams: list[RequestStream]):
    """Await `work`, but abort the requests if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            for s in streams:
                s.abort()
    if not task.done():  # nobody is left to answer
        raise APIError(499, "the client disconnected", "invalid_request_error")
    return task.result()


def _all_samples(out: RequestOutput, params: SamplingParams) -> list[CompletionOutput]:
    """All n completions of a request, in order (an aborted one may lack some)."""
    have = {c.index: c for c in out.outputs}
    return [have.get(i) or CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(params.n)]


def _finish_reason(c: CompletionOutput) -> str:
    return c.finish_reason or "abort"


def _usage(outputs: list[RequestOutput]) -> p.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


# -- logprobs in OpenAI's two shapes ---------------------------------------------------------


def _token_text(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"<{token_id}>"


def _chat_logprobs(entries: list[dict[int, Logprob]], params: SamplingParams) -> p.ChatChoiceLogprobs:
    content = []
    for entry in entries:
        token_id, lp = next(iter(entry.items()))  # the sampled token comes first
        text = _token_text(lp, token_id)
        tops = [p.TopLogprob(token=_token_text(t, tid), logprob=t.logprob, bytes=list(_token_text(t, tid).encode()))
                for tid, t in scoring.ranked(entry, params.logprobs or 0)]
        content.append(p.ChatCompletionTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                                    top_logprobs=tops))
    return p.ChatChoiceLogprobs(content=content)


def _completion_logprobs(entries: list[dict[int, Logprob]], params: SamplingParams,
                         offset: int) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for entry in entries:
        token_id, lp = next(iter(entry.items()))
        text = _token_text(lp, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.text_offset.append(offset)
        offset += len(text)
        top = {_token_text(t, tid): t.logprob for tid, t in scoring.ranked(entry, params.logprobs or 0)}
        out.top_logprobs.append(top if params.logprobs else None)
    return out


# -- streaming -------------------------------------------------------------------------------


def _sse(chunks: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:  # the stream ends with an error event, then [DONE], as vLLM's do
            if isinstance(e, (EngineStoppedError, RequestFailedError)):
                error = _engine_error(e)
            else:
                logger.exception("a stream failed")
                error = APIError(500, "internal server error (see the server log)", "server_error")
            info = p.ErrorInfo(message=error.message, type=error.type, code=error.status)
            yield f"data: {p.ErrorResponse(error=info).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (cancelled) or we are done: nothing stays in the engine
            for s in streams:
                s.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@dataclass
class _Sent:
    """How much of one choice the client has: text chars, logprob entries, done or not."""

    text: int = 0
    logprobs: int = 0
    done: bool = False


def _new_text(c: CompletionOutput, sent: _Sent, params: SamplingParams) -> str:
    """Text not sent yet. While running, the last len(longest stop) - 1 chars are held back:
    a stop string found later may cut them off, and sent text cannot be taken back."""
    end = len(c.text)
    if params.stop and not c.finished:
        end = max(sent.text, end - (max(len(s) for s in params.stop) - 1))
    delta = c.text[sent.text:end]
    sent.text = end
    return delta


def _new_logprobs(c: CompletionOutput, sent: _Sent) -> list[dict[int, Logprob]] | None:
    if c.logprobs is None:
        return None
    new = c.logprobs[sent.logprobs:]
    sent.logprobs = len(c.logprobs)
    return new


def _data(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _sse_lines(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Chunks as server-sent events, then [DONE]."""
    async for chunk in chunks:
        yield _data(chunk)
    yield "data: [DONE]\n\n"


async def _chat_chunks(stream: RequestStream, request_id: str, model: str, params: SamplingParams,
                       include_usage: bool, tools: ToolPlan) -> AsyncIterator[p.ChatCompletionChunk]:
    created = int(time.time())

    def chunk(choices: list[p.ChatCompletionStreamChoice], usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

    sent = [_Sent() for _ in range(params.n)]
    choice_streams = [tools.stream() for _ in range(params.n)]
    for i in range(params.n):  # the role first, as OpenAI does
        yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
    last: RequestOutput | None = None
    async for out in stream:
        last = out
        for c in out.outputs:
            s = sent[c.index]
            if s.done:
                continue
            text, logprobs = _new_text(c, s, params), _new_logprobs(c, s)
            s.done = c.finished
            deltas = choice_streams[c.index].deltas(c.text[:s.text], text, s.done)
            if deltas or logprobs or s.done:
                deltas = deltas or [p.DeltaMessage(content="")]
                for j, delta in enumerate(deltas):  # logprobs with the first, finish_reason with the last
                    closing = j == len(deltas) - 1
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=_chat_logprobs(logprobs, params) if logprobs is not None and j == 0 else None,
                        finish_reason=choice_streams[c.index].finish_reason(c) if s.done and closing else None,
                        stop_reason=c.stop_reason if closing else None)])
    for i, s in enumerate(sent):  # aborted (server shutting down) before the end
        if not s.done:
            yield chunk([p.ChatCompletionStreamChoice(index=i, delta=p.DeltaMessage(), finish_reason="abort")])
    if include_usage:
        yield chunk([], _usage([last] if last is not None else []))


async def _completion_chunks(streams: list[RequestStream], request_id: str, model: str, params: SamplingParams,
                             include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[p.CompletionChoice], usage: p.UsageInfo | None = None) -> str:
        return _data(p.CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                          usage=usage))

    sent = [[_Sent() for _ in range(params.n)] for _ in streams]
    last: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in _merge(streams):
        last[i] = out
        for c in out.outputs:
            s = sent[i][c.index]
            if s.done:
                continue
            offset = s.text
            text, logprobs = _new_text(c, s, params), _new_logprobs(c, s)
            s.done = c.finished
            if text or logprobs or s.done:
                yield chunk([p.CompletionChoice(
                    index=i * params.n + c.index, text=text,
                    logprobs=_completion_logprobs(logprobs, params, offset) if logprobs is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
    for i, per_prompt in enumerate(sent):
        for j, s in enumerate(per_prompt):
            if not s.done:
                yield chunk([p.CompletionChoice(index=i * params.n + j, text="", finish_reason="abort")])
    if include_usage:
        yield chunk([], _usage([o for o in last if o is not None]))
    yield "data: [DONE]\n\n"


# -- running it ------------------------------------------------------------------------------


def default_model_name(model: str | None) -> str:
    if model is None:
        from ember.loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return model


class _Server(uvicorn.Server):
    """uvicorn's Server with ember's shutdown: on SIGTERM / SIGINT it stops listening, gives
    the requests in flight `shutdown_timeout` s to finish, fails the rest with an error
    (their clients get an OpenAI-shaped 503, streams an error event and [DONE]), and only
    then lets uvicorn close the connections."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.ember_state = state

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # no new connection from here on
            server.close()
        await self.ember_state.drain()
        await super().shutdown(sockets)


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_names: list[str] | None = None, max_waiting_requests: int | None = None,
               shutdown_timeout: float = 30.0, log_level: str = "info", limits: p.RequestLimits | None = None,
               metrics_public: bool = False, cors: CORSOptions | None = None, log_requests: bool = False,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit code: 0 after a graceful stop, 1 if
    the model failed to load or the engine loop died (a supervisor should restart it)."""
    names = tuple(served_model_names or [default_model_name(engine_config.model)])
    resolved = engine_config.resolve()  # a bad model path or flag fails here, before listening
    config = ServerConfig(resolved, names, api_key, max_waiting_requests, shutdown_timeout,
                          limits or p.RequestLimits(), metrics_public, cors, log_requests, tool_call_parser,
                          reasoning_parser)
    app = build_app(config)
    state: ServerState = app.state.ember
    # uvicorn's own wait for connections comes after state.drain(): only the last bytes are left
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=5), state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    # uvicorn drains in-flight requests on SIGTERM / SIGINT, then re-raises the signal to the
    # handler that was in place before it: with this one there, the process exits 0.
    terminated = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: terminated.append(signum))
    logger.info("serving %s (%s) on http://%s:%d", names[0], Path(resolved.model).name, host, port)
    server.run()
    failed = state.load_error is not None or (state.engine is not None and state.engine.error is not None)
    code = 1 if failed else 0
    if state.engine is None and state.load_error is None:
        # stopped while the model loads: the loading thread may be deep in native code, where
        # the interpreter's exit would abort the process; leave at once instead
        logger.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
