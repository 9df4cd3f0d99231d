"""`ember serve --data-parallel-size N`: N replicas of the server, each a process of its own
with its share of the machine, behind ember's cache-aware router (ember/router) on the
address the user asked for.

A replica is `ember serve` with the same flags on a free localhost port: on the CPU it gets
cores / N threads (OMP_NUM_THREADS, unless set), on CUDA its tensor_parallel_size GPUs of those
visible (replica i the i-th run of them: at DP=2 x TP=2, GPUs 0,1 and 2,3). The
router sends each request to the replica whose prefix cache holds most of it (else the least
loaded), takes a replica that dies out of rotation, and answers 503 once none is left. When
the router stops, the replicas stop; a replica that fails to start stops the others and
ends the command with its exit code. With --data-parallel-backend ray the same replicas run
as Ray actors over a cluster's nodes (ray_replicas.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from ember.defaults import ENGINES_ON_HOST_VARIABLE
from ember.distributed.parallel_state import free_port

logger = logging.getLogger("ember.server")

_OWN_FLAGS = ("--data-parallel-size", "--dp-size", "--dp", "--data-parallel-backend", "--host", "--port")  # the parent's


def replica_argv(argv: list[str], port: int, host: str = "127.0.0.1") -> list[str]:
    """`serve`'s command line for one replica: the user's flags without the parent's own
    (`--flag value` or `--flag=value`), then the replica's address and size 1 (which also
    overrides a --config file's data-parallel-size)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out + ["--host", host, "--port", str(port), "--data-parallel-size", "1"]


def replica_env(index: int, size: int, device: str, gpus_per_replica: int = 1) -> dict[str, str]:
    """The environment of replica `index` of `size`: its GPUs (`gpus_per_replica` of those
    visible, the index-th run of them), or its share of the CPU's threads; and the count of
    replicas that share the host's memory (the default host tier's share, defaults.py)."""
    env = dict(os.environ) | {ENGINES_ON_HOST_VARIABLE: str(size)}
    if device == "cuda":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(size * gpus_per_replica)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * gpus_per_replica:(index + 1) * gpus_per_replica])
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    return env


def die_with_parent() -> None:
    """In a replica before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG),
    so a killed parent leaves no replica behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def wait_ready(procs: list[subprocess.Popen], urls: list[str], timeout: float, first: int = 0) -> None:
    """Until every replica answers GET /health with 200 (replica `first + i` is procs[i] at urls[i])."""
    deadline = time.monotonic() + timeout
    waiting = set(range(len(procs)))
    while waiting:
        for i in sorted(waiting):
            if procs[i].poll() is not None:
                raise RuntimeError(f"data-parallel replica {first + i} ({urls[i]}) exited with code "
                                   f"{procs[i].returncode} before it was ready: its log above says why")
            try:
                if httpx.get(f"{urls[i]}/health", timeout=2).status_code == 200:
                    waiting.discard(i)
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"data-parallel replicas {sorted(first + i for i in waiting)} were not ready after "
                               f"{timeout:.0f} s")
        if waiting:
            time.sleep(0.5)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the replicas drain), then SIGKILL what is left after 30 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_data_parallel(argv: list[str], size: int, device: str, host: str, port: int, log_level: str,
                      tensor_parallel_size: int = 1, ready_timeout: float = 900.0) -> int:
    """Start `size` replicas of `ember serve argv...` (each with `tensor_parallel_size` ranks
    of its own), then the router on host:port until it stops; returns the exit code."""
    from ember.router.app import RouterConfig, run_router

    if device == "cuda":
        import torch

        gpus = size * tensor_parallel_size
        if torch.cuda.device_count() < gpus:
            need = f"--data-parallel-size {size}" + (f" x --tensor-parallel-size {tensor_parallel_size}"
                                                      if tensor_parallel_size > 1 else "")
            raise ValueError(f"{need} needs {gpus} GPUs, and {torch.cuda.device_count()} are visible: lower "
                             f"{'them' if tensor_parallel_size > 1 else 'it'}, or run on the CPU (--device cpu)")
    ports = [free_port() for _ in range(size)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[subprocess.Popen] = []
    try:
        for i, replica_port in enumerate(ports):
            procs.append(subprocess.Popen([sys.executable, "-m", "ember.server.cli", *replica_argv(argv, replica_port)],
                                          env=replica_env(i, size, device, tensor_parallel_size),
                                          preexec_fn=die_with_parent))
        wait_ready(procs, urls, ready_timeout)
        logger.info("data parallel: %d replicas ready at %s; the router listens on %s:%d", size, ", ".join(urls),
                    host, port)
        run_router(RouterConfig(tuple(urls)), host, port, log_level)
        return 0
    finally:
        stop_processes(procs)
