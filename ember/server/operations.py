"""The operations routes vLLM serves, behind --api-key (but /ping):

    GET|POST /ping                 200 when ready, as /health (load balancers' probe)
    POST /reset_prefix_cache       drop every cached block; 409 while requests run
    POST /start_profile            the torch profiler on the engine core (--profiler-dir)
    POST /stop_profile             ... stopped: {"trace": the Chrome trace's path}
    POST /sleep?level=1|2          free the KV pool (1) and the weights (2): an RL loop's
    POST /wake_up                  trainer takes the memory, then the engine gets it back
    GET  /is_sleeping              {"is_sleeping": bool}

Each runs between two engine steps, in the core's process (AsyncEngine.call). While the
engine sleeps, generation routes answer 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.server.serving import ERRORS, APIError, ServerState


async def _call(state: ServerState, operation: str, *args: Any, status: int = 400) -> Any:
    engine = state.ready_engine()
    try:
        return await engine.call(operation, *args)
    except ValueError as e:  # the core says why it cannot now
        raise APIError(status, str(e)) from None


def add_operation_routes(app: FastAPI, state: ServerState, profiler_dir: str | None) -> None:
    @app.api_route("/ping", methods=["GET", "POST"], response_class=Response, responses=ERRORS)
    async def ping() -> Response:
        state.ready_engine()
        return Response(status_code=200)

    @app.post("/reset_prefix_cache", response_class=Response, responses=ERRORS)
    async def reset_prefix_cache() -> Response:
        if not await _call(state, "reset_prefix_cache"):
            raise APIError(409, "requests are running or waiting: the prefix cache is reset only when the engine is "
                                "idle", code="busy")
        return Response(status_code=200)

    def folder() -> str:
        if profiler_dir is None:
            raise APIError(400, "profiling is off: start the server with --profiler-dir DIR (or "
                                "EMBER_TORCH_PROFILER_DIR) to write traces there")
        return profiler_dir

    @app.post("/start_profile", response_class=Response, responses=ERRORS)
    async def start_profile() -> Response:
        await _call(state, "start_profile", folder())
        return Response(status_code=200)

    @app.post("/stop_profile", responses=ERRORS)
    async def stop_profile() -> dict[str, str]:
        folder()
        return {"trace": await _call(state, "stop_profile")}

    @app.post("/sleep", response_class=Response, responses=ERRORS)
    async def sleep(raw: Request) -> Response:
        params = dict(raw.query_params)
        unknown = sorted(params.keys() - {"level"})
        if unknown:
            raise APIError(400, f"/sleep takes only level; got {', '.join(unknown)}", param=unknown[0])
        level = params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 (the KV pool) or 2 (the KV pool and the weights); got {level!r:.20}",
                           param="level")
        await _call(state, "sleep", int(level), status=409)
        return Response(status_code=200)

    @app.post("/wake_up", response_class=Response, responses=ERRORS)
    async def wake_up(raw: Request) -> Response:
        if raw.query_params:
            name = next(iter(raw.query_params))
            raise APIError(400, f"/wake_up takes no parameters (ember wakes the KV pool and the weights together); "
                                f"got {name!r:.40}", param=name)
        await _call(state, "wake_up", status=409)
        return Response(status_code=200)

    @app.get("/is_sleeping", responses=ERRORS)
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": bool(state.ready_engine().sleeping)}
