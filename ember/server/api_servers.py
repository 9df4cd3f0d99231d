"""`ember serve --api-server-count N`: N API processes in front of one engine core process
(vLLM's --api-server-count), for when one interpreter's HTTP, SSE and detokenizing is what
limits a server of many streams.

    ember serve (this launcher: binds the port, starts the others, forwards SIGTERM, waits)
    ├── ember-core        core_process.py: one EngineCore, a pair of ZMQ sockets a client
    ├── API server 0      uvicorn + AsyncEngine over CoreConnection 0  ─┐ accept from the
    ├── ...                                                              │ one listening
    └── API server N-1    uvicorn + AsyncEngine over CoreConnection N-1 ─┘ socket

The socket is bound once here and inherited, not bound N times with SO_REUSEPORT: a second
`ember serve` on the port fails to bind instead of silently taking a share of its
connections, and the processes accept from one queue, so a busy one leaves new connections
to the others instead of having them hashed to it.

Each API process is a whole server (every route, its own tokenizer and output processor);
the core prefixes each one's request ids with its index (unique across them) and sends each
step's outputs to the process whose requests they are (core_process.ClientTable). The
operations routes (/sleep, /reset_prefix_cache, the profiler) are CALLs to that one core, so
they act once, and its sleep level reaches every process with the next step.

/metrics: every process answers with the same totals. The core's numbers (gauges, preemptions,
prefix cache, drafts) come from its own counters, in the EngineStats every process gets each
step; the API side's (tokens, finished requests, latency histograms) are summed over the
processes by prometheus_client's multiprocess mode (a file each under PROMETHEUS_MULTIPROC_DIR,
set here): each process sees only its own requests, and summing keeps a killed process's
counts, so a total never goes back.

Failures: a dead core process ends every API process (503 on /health, an error event in each
open stream, exit 1), then this one (exit 1). A killed API process loses its connections; the
core aborts its requests (their blocks go back at once) and the others keep serving; this one
then exits 1 when it stops. SIGTERM (or SIGINT) here goes to every API process, which drains;
the core serves until the last has left, then stops.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import uvicorn

from ember.engine.core_client import CoreConnection
from ember.engine.core_process import run_core_process
from ember.server.data_parallel import die_with_parent
from ember.server.serving import ServerConfig

logger = logging.getLogger("ember.server")

CORE_STOP_S = 10.0  # how long the core gets to stop after the last API process left


def run_api_servers(config: ServerConfig, uvicorn_options: dict[str, Any],
                    serve: Callable[[ServerConfig, dict[str, Any], list], int]) -> int:
    """Start the engine core and `config.api_server_count` API processes, each running
    serve(its config, uvicorn_options, [the listening socket]); wait for them; the exit code:
    0 when every API process stopped cleanly, else 1."""
    count = config.api_server_count
    bind = uvicorn.Config("ember", host=uvicorn_options["host"], port=uvicorn_options["port"],
                          log_level=uvicorn_options.get("log_level"))
    sock = bind.bind_socket()  # a port in use ends the command here, as with one API process
    directory = tempfile.mkdtemp(prefix="ember-serve-")
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
    addresses = [(f"ipc://{directory}/input-{i}", f"ipc://{directory}/output-{i}") for i in range(count)]
    core = spawn.Process(target=run_core_process, args=(config.engine, addresses, "`ember serve`'s launcher"),
                         name="ember-core", daemon=False)  # it starts TP workers of its own
    servers: list[multiprocessing.process.BaseProcess] = []
    metrics = os.path.join(directory, "metrics")
    os.mkdir(metrics)
    try:
        core.start()
        own_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics  # read when prometheus_client is imported: the children
        try:
            for i in range(count):
                own = dataclasses.replace(config, core_connection=CoreConnection(*addresses[i], core.pid, i))
                server = spawn.Process(target=_api_server, args=(serve, own, uvicorn_options, sock),
                                       name=f"ember-api-{i}", daemon=False)
                server.start()
                servers.append(server)
        finally:
            if own_dir is None:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_dir
            sock.close()  # theirs now: once they all close it, the port is free
        logger.info("%d API servers (processes %s) in front of the engine core (process %d)", count,
                    ", ".join(str(s.pid) for s in servers), core.pid)
        return _wait(core, servers)
    finally:
        for server in servers:  # only left on an error here: they exited already otherwise
            if server.is_alive():
                server.kill()
                server.join(5)
        if core.is_alive():
            core.join(CORE_STOP_S)
            if core.is_alive():
                logger.warning("the engine core did not stop within %g s: killing it", CORE_STOP_S)
                core.kill()
                core.join(5)
        shutil.rmtree(directory, ignore_errors=True)


def _wait(core: multiprocessing.process.BaseProcess, servers: list[multiprocessing.process.BaseProcess]) -> int:
    """Until every API process has exited (forwarding SIGTERM / SIGINT to them); the exit code."""
    stopping: list[int] = []

    def stop(signum, frame) -> None:
        if not stopping:
            stopping.append(signum)
            logger.info("stopping: the API servers drain their requests")
            for server in servers:
                if server.is_alive():
                    os.kill(server.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    code = 0
    live = {server.sentinel: (i, server) for i, server in enumerate(servers)}
    core_watched = True
    while live:
        ready = multiprocessing.connection.wait([*live, core.sentinel] if core_watched else list(live))
        for sentinel in ready:
            if sentinel == core.sentinel:
                core_watched = False
                core.join(1)
                if core.exitcode:  # (0: it stopped when the last API process left)
                    logger.error("the engine core process exited (exit code %s): every API server stops", core.exitcode)
                    code = 1
                continue
            i, server = live.pop(sentinel)
            server.join()
            if server.exitcode:
                code = 1
            if server.exitcode and not stopping and core.is_alive():
                logger.error("API server %d (process %d) exited with code %s: %d left serving", i, server.pid,
                             server.exitcode, len(live))
    return code


def _api_server(serve: Callable[[ServerConfig, dict[str, Any], list], int], config: ServerConfig,
                uvicorn_options: dict[str, Any], sock) -> None:
    """One API process: the server on the launcher's socket, over its share of the core."""
    die_with_parent()  # SIGTERM (a drain) if the launcher is killed
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ember").setLevel(logging.INFO)
    sys.exit(serve(config, uvicorn_options, [sock]))
