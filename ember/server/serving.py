"""What every route family of the server shares: its configuration and state, OpenAI's
error shape, and the way a route hands requests to the engine and collects their outputs
(prepare on the input pool, submit, the final outputs or a disconnect, usage).

Routes: openai_api.py (health, version, metrics, models) and the families beside it:
completions.py, chat.py (chat completions and Responses), tokens.py, embeddings.py."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse

from ember.config import EngineConfig
from ember.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStoppedError,
    RequestFailedError,
    RequestStream,
)
from ember.engine.core_client import CoreConnection, StartedCore
from ember.outputs import CompletionOutput, RequestOutput
from ember.request import Request as EngineRequest
from ember.sampling_params import SamplingParams
from ember.server import protocol as p

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
    api_keys: tuple[str, ...] = ()  # any of them opens the routes (--api-key); none: no key needed
    max_waiting_requests: int | None = None
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    limits: p.RequestLimits = p.RequestLimits()
    metrics_public: bool = False  # /metrics without the API key
    cors: CORSOptions | None = None  # None: no CORS headers (browsers refuse other origins)
    log_requests: bool = False  # each request's id, prompt length and sampling parameters at INFO
    # reads tool_choice "auto" outputs (--tool-call-parser); None: the one the chat template shows
    # (parsers.infer_tool_parser); "": "auto" refused (--no-auto-tool-choice)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # splits off <think> reasoning (--reasoning-parser)
    core_process: bool = True  # the engine core in its own process (--no-core-process: a thread of this one)
    force_include_usage: bool = False  # every stream ends with a usage chunk (--enable-force-include-usage)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under a request's own
    log_stats: bool = True  # the periodic stats line (--disable-log-stats: off)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:ID" unless a request says no
    trust_request_chat_template: bool = False  # a request may bring its own chat_template
    profiler_dir: str | None = None  # where /stop_profile writes traces (None: profiling off)
    api_server_count: int = 1  # API processes in front of one engine core (--api-server-count)
    core_connection: CoreConnection | None = None  # with several: the core the launcher started, this one's sockets
    started_core: StartedCore | None = None  # with one: its core, started before the app (run_server)

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
        """The name a response carries: the served name the request gave (as vLLM), else the first."""
        if model is None:
            return self.config.model_name
        if model in self.config.served_model_names:
            return model
        raise APIError(404, f"The model `{model}` does not exist. This server serves: "
                       f"{', '.join(self.config.served_model_names)}", param="model", code="model_not_found")

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Build the engine (runs on its own thread)."""
        try:
            engine = AsyncEngine(self.config.engine, self.config.max_waiting_requests, self.stat_loggers,
                                 on_dead=lambda e: self.engine_died(loop), log_requests=self.config.log_requests,
                                 core_process=self.config.core_process,
                                 core_connection=self.config.core_connection or self.config.started_core)
            engine.warm_up()
        except BaseException as e:
            logger.exception("the model failed to load")
            self.load_error = e
            if self.on_fatal is not None:
                loop.call_soon_threadsafe(self.on_fatal)
            return
        # what is alive now (the model, torch, the app) lives as long as the server: out of the
        # garbage collector's sight, a full collection while a request parses takes ms, not 100
        gc.freeze()
        logger.info("ready: %s (%d KV blocks of %d tokens, max_model_len %d); the engine core runs in process %d",
                    self.config.model_name, engine.num_kv_blocks, engine.config.block_size,
                    engine.config.max_model_len, engine.core_pid)
        self.engine = engine  # /health says 200 from here, with the line above in the log
        if self.stopping:  # SIGTERM came while it loaded
            engine.stop()


async def prepare(engine: AsyncEngine, fn, *args):
    """fn(*args) on the engine's input pool; what the input makes it raise becomes its status."""
    try:
        return await engine.prepare(fn, *args)
    except Exception as e:
        raise input_error(e) from None


def submit(engine: AsyncEngine, requests: list[EngineRequest]) -> list[RequestStream]:
    """Queue every request of one HTTP request, or none."""
    if engine.sleeping:
        raise APIError(503, "the engine is asleep: POST /wake_up first", "server_error", code="sleeping")
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
            raise engine_error(e) from None
        if isinstance(e, ValueError):
            raise bad_request(e) from None
        raise
    return streams


ERROR_RESPONSE = {"model": p.ErrorResponse}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "Invalid request", **ERROR_RESPONSE},
    401: {"description": "Invalid or missing API key (with --api-key)", **ERROR_RESPONSE},
    404: {"description": "Unknown model or route", **ERROR_RESPONSE},
    413: {"description": "Request body too large", **ERROR_RESPONSE},
    500: {"description": "Internal error", **ERROR_RESPONSE},
    503: {"description": "Loading, overloaded or shutting down", **ERROR_RESPONSE},
}
STREAMED_ERRORS = {**ERRORS, 200: {"description": "The response, or with stream=true server-sent events of "
                                                    "chunks", "content": {"text/event-stream": {}}}}


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def engine_error(e: Exception) -> APIError:
    """The error a request's client gets when the engine ends it without a result."""
    if isinstance(e, RequestFailedError):
        return APIError(500, f"the request failed while generating: {e}", "server_error")
    if isinstance(e, EngineDeadError):  # its text names the exception: that stays in the log
        return APIError(503, "the engine loop died: the server is going down (see its log)", "server_error")
    return APIError(503, str(e), "server_error")


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge(streams):
            finals[i] = out
    except (EngineStoppedError, RequestFailedError) as e:
        raise engine_error(e) from None
    missing = [s.request_id for s, f in zip(streams, finals) if f is None]
    if missing:  # aborted before its first token (shutdown)
        raise APIError(503, "the request was aborted: the server is shutting down", "server_error")
    return finals


async def until_disconnected(raw: Request, work: Awaitable, streams: list[RequestStream]):
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


def all_samples(out: RequestOutput, params: SamplingParams) -> list[CompletionOutput]:
    """All n completions of a request, in order (an aborted one may lack some)."""
    have = {c.index: c for c in out.outputs}
    return [have.get(i) or CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(params.n)]


def choice_finish_reason(c: CompletionOutput) -> str:
    return c.finish_reason or "abort"


def engine_prompt(engine: AsyncEngine, prompt: str | dict[str, Any], add_special_tokens: bool = True,
                  truncate: int | None = None, cache_salt: str | None = None) -> str | dict[str, Any]:
    """A prompt with vLLM's add_special_tokens (for text), truncate_prompt_tokens (keep the
    last k tokens; -1: max_model_len) and cache_salt applied."""
    if cache_salt is not None:
        prompt = {"prompt": prompt, "cache_salt": cache_salt} if isinstance(prompt, str) else \
            {**prompt, "cache_salt": cache_salt}
    if add_special_tokens and truncate is None:
        return prompt
    if isinstance(prompt, str) or "prompt_token_ids" not in prompt:
        text = prompt if isinstance(prompt, str) else prompt["prompt"]
        prompt = {"prompt": text, "prompt_token_ids": engine.inputs.encode(text, add_special_tokens),
                  "cache_salt": cache_salt}
    if truncate is None:
        return prompt
    max_model_len = engine.config.max_model_len
    if truncate == 0 or truncate > max_model_len:
        raise p.InvalidRequest(f"truncate_prompt_tokens must be -1 (max_model_len) or in [1, {max_model_len}] "
                               f"(max_model_len); got {truncate}", "truncate_prompt_tokens")
    keep = max_model_len if truncate == -1 else truncate
    ids = prompt["prompt_token_ids"]
    if len(ids) <= keep:
        return prompt
    return {"prompt_token_ids": ids[-keep:], "cache_salt": cache_salt}  # the text is the whole prompt's: dropped


def usage_info(outputs: list[RequestOutput]) -> p.UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))
