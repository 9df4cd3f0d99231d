"""The OpenAI-compatible HTTP server: FastAPI routes in front of one AsyncEngine, assembled
here from the route families (each its own file, over serving.py's shared parts):

    POST /v1/chat/completions   POST /v1/responses   POST /v1/messages   chat.py (stream or not)
    POST /v1/completions                                 completions.py (stream or not)
    POST /tokenize   POST /detokenize   GET /tokenizer_info   tokens.py
    POST /v1/embeddings                                  embeddings.py (--runner pooling)
    POST /score, /rerank, /v2/rerank, /pooling, /classify   retrieval.py (--runner pooling)
    GET  /v1/models   GET /health (503 until the model is loaded)   GET /version   GET /metrics   here
    /ping, /reset_prefix_cache, /start_profile, /stop_profile, /sleep, /wake_up   operations.py

Every request is validated at the route (strict pydantic shapes and ranges, RequestLimits,
SamplingParams, chat template, tokenize, prompt length): bad input is refused with 400
before it reaches the engine. Work that grows with the input (templates,
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
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response

import ember
from ember.config import EngineConfig
from ember.engine.async_engine import AsyncEngine
from ember.engine.core_client import StartedCore
from ember.engine.stats import LoggingStatLogger
from ember.server import protocol as p
from ember.server.api_servers import run_api_servers
from ember.server.chat import add_chat_routes, add_messages_routes, add_stored_response_routes
from ember.server.completions import add_completion_routes
from ember.server.launch_flags import check_api_server_count
from ember.server.metrics import ServerMetrics
from ember.server.middleware import (
    OPEN_PATHS,
    APIKeyMiddleware,
    BodyMiddleware,
    ServedByMiddleware,
    add_error_handlers,
    document_errors,
)
from ember.server.operations import add_operation_routes
from ember.server.retrieval import add_retrieval_routes
from ember.server.serving import ERRORS, CORSOptions, ServerConfig, ServerState
from ember.server.sglang_api import add_sglang_routes
from ember.server.tokens import add_token_routes

logger = logging.getLogger("ember.server")

__all__ = ["build_app", "run_server", "ServerConfig", "CORSOptions"]


# -- the app ---------------------------------------------------------------------------------


def build_app(config: ServerConfig, engine: AsyncEngine | None = None) -> FastAPI:
    """The FastAPI app. With `engine` given it serves that one (already loaded); otherwise
    it loads one from `config.engine` in the background once the server starts."""
    state = ServerState(config, engine)
    metrics = ServerMetrics(config.model_name, lambda: state.engine.current_stats() if state.engine else None,
                            multiprocess=config.api_server_count > 1)
    label = f"API server {config.core_connection.index}: " if config.core_connection is not None else ""
    state.stat_loggers = [LoggingStatLogger(label=label), metrics.stat_logger] if config.log_stats else \
        [metrics.stat_logger]
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

    app.add_middleware(RunnerRoutes, state=state)
    app.add_middleware(BodyMiddleware, max_bytes=limits.max_body_bytes)
    if config.api_keys:  # added last, so it runs first: no body is read for a client without the key
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys,
                           open_paths=OPEN_PATHS | ({"/metrics"} if config.metrics_public else set()))
    if config.core_connection is not None:
        app.add_middleware(ServedByMiddleware, index=config.core_connection.index)
    if config.cors is not None:  # outermost: a preflight carries no API key
        cors = config.cors
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                           allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                           allow_credentials=cors.allow_credentials)
    add_error_handlers(app)
    add_embeddings_route(app, state, limits)
    add_retrieval_routes(app, state, limits)

    @app.get("/health", response_class=Response, responses={200: {"description": "Ready (an empty body)"}, **ERRORS})
    async def health() -> Response:
        state.ready_engine()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": ember.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models", response_model=p.ModelList, responses=ERRORS)
    async def models() -> dict[str, Any]:
        cards = [p.ModelCard(id=name, root=name, max_model_len=config.engine.max_model_len,
                             created=int(state.started)) for name in config.served_model_names]
        return p.ModelList(data=cards).model_dump()

    add_token_routes(app, state)
    add_chat_routes(app, state)
    add_messages_routes(app, state)
    add_stored_response_routes(app)
    add_completion_routes(app, state)
    add_operation_routes(app, state, config.profiler_dir)
    add_sglang_routes(app, state)
    document_errors(app)
    return app


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


def run_server(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
               api_keys: Sequence[str] = (), served_model_names: Sequence[str] = (),
               max_waiting_requests: int | None = None, shutdown_timeout: float = 30.0, log_level: str = "info",
               limits: p.RequestLimits | None = None, metrics_public: bool = False, cors: CORSOptions | None = None,
               log_requests: bool = False, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               core_process: bool = True, uvicorn_options: Mapping[str, Any] | None = None,
               force_include_usage: bool = False, default_chat_template_kwargs: Mapping[str, Any] | None = None,
               log_stats: bool = True, return_tokens_as_token_ids: bool = False,
               trust_request_chat_template: bool = False, profiler_dir: str | None = None,
               api_server_count: int = 1, started_core: StartedCore | None = None) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit code: 0 after a graceful stop, 1 if
    the model failed to load or the engine loop died (a supervisor should restart it).
    `uvicorn_options`: uvicorn.Config's root_path and ssl_* (launch_flags.py);
    `api_server_count`: API processes in front of one engine core process (api_servers.py);
    `started_core`: the core process of `engine_config` (resolved), started already (`ember serve`)."""
    check_api_server_count(api_server_count, core_process=core_process,
                           executor_backend=engine_config.distributed_executor_backend)
    names = tuple(served_model_names) or (default_model_name(engine_config.model),)
    resolved = engine_config.resolve()  # a bad model path or flag fails here, before listening
    config = ServerConfig(resolved, names, tuple(api_keys), max_waiting_requests, shutdown_timeout,
                          limits or p.RequestLimits(), metrics_public, cors, log_requests, tool_call_parser,
                          reasoning_parser, core_process, force_include_usage,
                          dict(default_chat_template_kwargs or {}), log_stats, return_tokens_as_token_ids,
                          trust_request_chat_template, profiler_dir, api_server_count, started_core=started_core)
    # uvicorn's own wait for connections comes after state.drain(): only the last bytes are left
    options = dict(host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, **(uvicorn_options or {}))
    logger.info("serving %s (%s) on http://%s:%d", names[0], Path(resolved.model).name, host, port)
    if api_server_count > 1:
        return run_api_servers(config, options, serve)
    return serve(config, options)


def serve(config: ServerConfig, uvicorn_options: dict[str, Any], sockets: list | None = None) -> int:
    """Run the app of `config` on uvicorn until SIGTERM / SIGINT (listening on `sockets` where
    given: an API process of several, on the socket its launcher bound); the exit code."""
    app = build_app(config)
    state: ServerState = app.state.ember
    server = _Server(uvicorn.Config(app, **uvicorn_options), state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    # uvicorn drains in-flight requests on SIGTERM / SIGINT, then re-raises the signal to the
    # handler that was in place before it: with this one there, the process exits 0.
    terminated = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: terminated.append(signum))
    server.run(sockets=sockets)
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
