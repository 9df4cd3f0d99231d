"""The server's ASGI middleware (the API key, the body's size and text, which API process
answered) and its error
handlers: every error in OpenAI's shape, and an OpenAPI schema that says so."""

from __future__ import annotations

import logging
import os
import secrets
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.server import protocol as p
from ember.server.messages import error_body
from ember.server.serving import APIError, input_error

logger = logging.getLogger("ember.server")

# open without the API key: liveness, the version, and the API's own description
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class APIKeyMiddleware:
    """401 without `Authorization: Bearer <key>` on every route but `open_paths` (llama-server's
    rule: anything that takes input or tells about the served model needs the key)."""

    def __init__(self, app, api_keys: tuple[str, ...], open_paths: frozenset[str] | set[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        # behind --root-path the ASGI path carries the prefix (the spec's rule): the route is what follows it
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and path not in self.open_paths and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization") or b"Bearer " + headers.get(b"x-api-key", b"")  # Anthropic's header
            if not any([secrets.compare_digest(given, key) for key in self.expected]):  # each compared: no early out
                error = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                                      "'x-api-key: <key>')", code="invalid_api_key")
                await shaped(error, path)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServedByMiddleware:
    """With several API processes (--api-server-count): every response names the one that
    answered, `x-ember-api-server: <index> <pid>` (for logs, py-spy and the tests)."""

    def __init__(self, app, index: int) -> None:
        self.app = app
        self.header = (b"x-ember-api-server", f"{index} {os.getpid()}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


class BodyMiddleware:
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


def shaped(error: APIError, path: str) -> JSONResponse:
    """The error in the shape of the API its route belongs to: Anthropic's for /v1/messages,
    else OpenAI's."""
    if path.startswith("/v1/messages"):
        return JSONResponse(error_body(error.status, error.message), status_code=error.status, headers=error.headers)
    return error.response()


def _route(request: Request) -> str:
    return request.url.path.removeprefix(request.scope.get("root_path", ""))


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return shaped(e, _route(request))

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
        return shaped(APIError(400, "invalid request: " + "; ".join(parts), param=param), _route(request))

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


def document_errors(app: FastAPI) -> None:
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
