"""The HTTP side of `ember router`: a FastAPI proxy in front of `ember serve` workers.

    POST /v1/completions, /v1/chat/completions   to the worker the policy picks (streams relayed)
    GET  /v1/models                              from the first healthy worker
    GET  /health                                 200 while a worker is healthy, else 503
    GET  /router/stats                           per worker: healthy, in flight, routed

Requests are forwarded as they come (the Authorization header included): the workers
validate them. A worker is taken out of rotation when a request to it fails at the
connection or a periodic GET /health fails, and put back when /health says 200 again. A
request that could not connect is sent to another worker. A request running on a worker
whose connection breaks (it died), or whose /health times out (it hangs), ends with an
OpenAI-shaped 502 (a stream: an error event, then [DONE]), never a hang; a worker that
refuses /health while it drains on SIGTERM keeps its running requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.router.policy import CacheAwarePolicy, NoHealthyWorker, PolicyConfig, WorkerState

logger = logging.getLogger("ember.router")

T = TypeVar("T")

# connection-level headers belong to one hop; content-length, date and server are set again for
# what the router sends
_HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "content-length", "accept-encoding",
                          "content-encoding", "date", "server"})


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...]
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    health_check_interval: float = 5.0  # seconds between GET /health of every worker
    health_check_timeout: float = 5.0
    connect_timeout: float = 5.0
    worker_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # by URL: shown in /router/stats


class WorkerFailed(Exception):
    """The worker a request runs on stopped answering (its GET /health timed out)."""


def error_body(message: str, type: str = "server_error", code: int | str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)


def routing_text(body: Any) -> str:
    """The text a request's prefix is matched on: a completion's prompt, or the chat messages
    one after another (role and text). Approximate by design: only its prefixes matter."""
    if not isinstance(body, dict):
        return ""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        return "".join(f"<{m.get('role')}>{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):  # a batch: the first prompt
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


class Router:
    """The policy, the workers' health, and the HTTP client the requests go through."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy = CacheAwarePolicy([url.rstrip("/") for url in config.workers], config.policy)
        # set when a worker hangs: the requests running there stop waiting for it
        self._failed = {w.url: asyncio.Event() for w in self.policy.workers}
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "the router is not started"
        return self._client

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=self.config.connect_timeout),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._client is not None:
            await self._client.aclose()

    # ---- health ----------------------------------------------------------------------

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.policy.workers))

    async def _check(self, worker: WorkerState) -> None:
        hangs = False
        try:
            r = await self.client.get(f"{worker.url}/health", timeout=self.config.health_check_timeout)
            problem = None if r.status_code == 200 else f"GET /health answered {r.status_code}"
        except httpx.HTTPError as e:
            problem = f"GET /health failed: {_describe(e)}"
            hangs = isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout)
        if problem is not None:
            self.take_out(worker, problem, fail_running=hangs)
        elif not worker.healthy:
            logger.info("worker %s is healthy: back in rotation", worker.url)
            self._failed[worker.url] = asyncio.Event()
            self.policy.mark_up(worker)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            await self.check_health()

    def take_out(self, worker: WorkerState, reason: str, fail_running: bool = False) -> None:
        """No new request goes to `worker`; with `fail_running` the running ones end with an error."""
        if worker.healthy:
            logger.warning("worker %s is out of rotation: %s", worker.url, reason)
            self.policy.mark_down(worker)
        if fail_running:
            self._failed[worker.url].set()

    # ---- requests --------------------------------------------------------------------

    async def forward(self, request: Request, path: str) -> Response:
        content = await request.body()
        try:
            body = json.loads(content)
        except ValueError:
            body = None  # the worker answers 400
        text = routing_text(body)
        stream = isinstance(body, dict) and body.get("stream") is True
        headers = _forwarded(request.headers) | {"accept-encoding": "identity"}
        tried: set[str] = set()
        while True:
            try:
                worker = self.policy.route(text, frozenset(tried))
            except NoHealthyWorker:
                return _no_worker(self.policy)
            failed = self._failed[worker.url]
            upstream_request = self.client.build_request("POST", f"{worker.url}{path}", content=content,
                                                         headers=headers)
            try:
                upstream = await _unless(self.client.send(upstream_request, stream=True), failed, request)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached it: another may take it
                self.policy.finished(worker)
                self.take_out(worker, f"{type(e).__name__}: {e}")
                tried.add(worker.url)
            except (httpx.HTTPError, WorkerFailed) as e:
                self.policy.finished(worker)
                self.take_out(worker, _describe(e))
                return error_response(502, _failed_message(worker, e))
            except ClientGone:
                self.policy.finished(worker)
                return Response(status_code=499)  # nobody reads it
            except BaseException:  # the router stops
                self.policy.finished(worker)
                raise

        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await upstream.aclose()  # closes the connection if unread: the worker drops the request
                self.policy.finished(worker)

        if stream and upstream.status_code == 200:
            return _Relay(self._relay(worker, failed, upstream, release), release, _forwarded(upstream.headers))
        try:
            answer = await _unless(upstream.aread(), failed, request)
        except (httpx.HTTPError, WorkerFailed) as e:
            self.take_out(worker, _describe(e))
            return error_response(502, _failed_message(worker, e))
        except ClientGone:
            return Response(status_code=499)
        finally:
            await release()
        return Response(answer, status_code=upstream.status_code, headers=_forwarded(upstream.headers))

    async def _relay(self, worker: WorkerState, failed: asyncio.Event, upstream: httpx.Response,
                     release: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        """The worker's server-sent events, whole ones only: if it fails mid-stream the client
        gets an error event and [DONE] after the last complete event."""
        pending = b""
        chunks = upstream.aiter_raw()
        try:
            while True:
                try:
                    chunk = await _unless(chunks.__anext__(), failed)
                except StopAsyncIteration:
                    break
                except (httpx.HTTPError, WorkerFailed) as e:
                    self.take_out(worker, _describe(e))
                    body = error_body(_failed_message(worker, e), code=502)
                    yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
                    return
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending
        finally:
            await release()

    async def models(self, request: Request) -> Response:
        """GET /v1/models of the first healthy worker (the workers serve the same model)."""
        headers = _forwarded(request.headers) | {"accept-encoding": "identity"}
        for worker in self.policy.workers:
            if not worker.healthy:
                continue
            try:
                r = await self.client.get(f"{worker.url}/v1/models", headers=headers,
                                          timeout=self.config.health_check_timeout)
            except httpx.HTTPError as e:
                self.take_out(worker, _describe(e))
                continue
            return Response(r.content, status_code=r.status_code, headers=_forwarded(r.headers))
        return _no_worker(self.policy)

    async def broadcast(self, request: Request, path: str) -> Response:
        """An operations route on every healthy worker at once (each server acts on its own
        engine): 200 with the first worker's answer when all say 2xx, else the first failing
        worker's status, its message prefixed with the worker; /is_sleeping: true only when
        every worker sleeps."""
        workers = [w for w in self.policy.workers if w.healthy]
        if not workers:
            return _no_worker(self.policy)
        content = await request.body()
        headers = _forwarded(request.headers) | {"accept-encoding": "identity"}

        async def one(worker: WorkerState) -> tuple[int, bytes]:
            try:
                r = await self.client.request(request.method, f"{worker.url}{path}", params=request.query_params,
                                              content=content, headers=headers)
            except httpx.HTTPError as e:
                self.take_out(worker, _describe(e))
                return 502, json.dumps(error_body(f"the worker {worker.url} did not answer ({_describe(e)})")).encode()
            return r.status_code, r.content

        answers = await asyncio.gather(*(one(w) for w in workers))
        for worker, (status, content) in zip(workers, answers):
            if status >= 300:
                try:
                    message = json.loads(content)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = content.decode(errors="replace")[:500]
                return JSONResponse(error_body(f"{worker.url}: {message}", code=status), status_code=status)
        if path == "/is_sleeping":
            return JSONResponse({"is_sleeping": all(json.loads(c)["is_sleeping"] for _, c in answers)})
        return Response(answers[0][1], status_code=answers[0][0],
                        media_type="application/json" if answers[0][1] else None)

    def stats(self) -> dict[str, Any]:
        return {"workers": [{"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight, "routed": w.routed,
                             "cache_routed": w.cache_routed, "tree_chars": w.tree.size}
                            | self.config.worker_info.get(w.url, {})
                            for w in self.policy.workers]}


class ClientGone(Exception):
    """The client closed its connection."""


async def _unless(work: Awaitable[T], failed: asyncio.Event, client: Request | None = None) -> T:
    """`work`, unless the worker hangs first (`failed` is set: WorkerFailed) or `client` goes away
    (ClientGone); either cancels it."""
    task = asyncio.ensure_future(work)
    if failed.is_set():
        task.cancel()
        raise WorkerFailed
    hang = asyncio.ensure_future(failed.wait())
    gone = asyncio.ensure_future(_disconnected(client)) if client is not None else None
    waiters = {hang} if gone is None else {hang, gone}
    try:
        await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    if gone is not None and gone.done() and not gone.cancelled():
        raise ClientGone
    raise WorkerFailed


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Relay(StreamingResponse):
    """A stream that releases its worker however it ends, even if it never starts (the client
    left before the first byte)."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        super().__init__(body, status_code=200, headers=headers)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._release()


def _forwarded(headers: httpx.Headers | Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


def _describe(e: Exception) -> str:
    return "it stopped answering" if isinstance(e, WorkerFailed) else f"{type(e).__name__}: {e}"


def _failed_message(worker: WorkerState, e: Exception) -> str:
    return f"the worker {worker.url} failed during the request ({_describe(e)}): retry"


def _no_worker(policy: CacheAwarePolicy) -> JSONResponse:
    down = [w.url for w in policy.workers if not w.healthy]
    return error_response(503, f"no healthy worker to take the request (out of rotation: {', '.join(down)}): "
                               "retry when one is back")


# the workers' POST routes that take one request and answer it (each goes to one worker)
FORWARDED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/embeddings", "/tokenize", "/detokenize", "/score", "/v1/score", "/rerank", "/v1/rerank",
             "/v2/rerank", "/pooling", "/classify")
# the operations routes, which act on a server's own engine: sent to every worker (Router.broadcast)
BROADCAST = {"/reset_prefix_cache": "POST", "/start_profile": "POST", "/stop_profile": "POST", "/sleep": "POST",
             "/wake_up": "POST", "/is_sleeping": "GET"}


def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="ember router", lifespan=lifespan)
    app.state.router = router

    def forwarding(path: str):
        async def forward(request: Request) -> Response:
            return await router.forward(request, path)

        return forward

    for path in FORWARDED:
        app.post(path)(forwarding(path))

    def broadcasting(path: str):
        async def broadcast(request: Request) -> Response:
            return await router.broadcast(request, path)

        return broadcast

    for path, method in BROADCAST.items():
        app.api_route(path, methods=[method])(broadcasting(path))

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> Response:
        if any(w.healthy for w in router.policy.workers):
            return Response(status_code=200)
        return _no_worker(router.policy)

    @app.get("/router/stats")
    async def stats() -> dict[str, Any]:
        return router.stats()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), status_code=e.status_code)

    return app


def run_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    logger.info("routing to %s on http://%s:%d", ", ".join(config.workers), host, port)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then re-raises the signal to the handler in
    # place before it: with this one there, the process exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.run(build_router_app(config), host=host, port=port, log_level=log_level)

