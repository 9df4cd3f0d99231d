"""`ember serve --data-parallel-size N --data-parallel-backend ray`: the N replicas of
data_parallel.py placed by Ray over the nodes of the cluster RAY_ADDRESS names (else a new
local one), with the router in front in this process, as with the process backend.

A placement group holds one bundle per replica ({"CPU": its threads}, and {"GPU":
tensor_parallel_size} on CUDA) with the SPREAD strategy: on different nodes where there are
several. Each replica is a Ray actor on its bundle that runs the same `ember serve` as the
process backend on its node's address and a free port (with the bundle's threads; on CUDA
Ray shows it the bundle's GPUs), and reports where it listens and on which node. The
replicas, their actors and the placement group end with the command; when the command is
killed, Ray ends the actors it owned, and each replica's server dies with its actor.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

from ember.defaults import ENGINES_ON_HOST_VARIABLE
from ember.distributed.parallel_state import free_port
from ember.server.data_parallel import die_with_parent, replica_argv, replica_env, stop_processes, wait_ready

logger = logging.getLogger("ember.server")

PLACEMENT_TIMEOUT_S = 120  # for the cluster to find room for every replica
STOP_TIMEOUT_S = 60  # for a replica to drain and exit before its actor is killed


class Replica:
    """A Ray actor: one replica's `ember serve`, a child process that dies with the actor."""

    def __init__(self, argv: list[str], index: int, threads: int, size: int) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.index, self.url = index, f"http://{host}:{port}"
        # every replica counts as one of this host's (the default host tier's share, defaults.py): SPREAD
        # may place several on a node
        env = os.environ | {"OMP_NUM_THREADS": str(threads), ENGINES_ON_HOST_VARIABLE: str(size)}
        # the actor's methods run on its main thread: the child's parent-death signal fires
        # when the actor's process ends, not when a call returns
        self.proc = subprocess.Popen([sys.executable, "-m", "ember.server.cli", *replica_argv(argv, port, host)],
                                     env=env, preexec_fn=die_with_parent)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Where the replica listens, once it answers /health, and where it runs."""
        import ray

        wait_ready([self.proc], [self.url], timeout, first=self.index)
        context = ray.get_runtime_context()
        return {"url": self.url, "ray_node_id": context.get_node_id(), "ray_actor_id": context.get_actor_id(),
                "actor_pid": os.getpid(), "pid": self.proc.pid}

    def stop(self) -> int:
        stop_processes([self.proc])
        return self.proc.returncode


def run_ray_replicas(argv: list[str], size: int, device: str, tensor_parallel_size: int, host: str, port: int,
                     log_level: str, ready_timeout: float = 900.0) -> int:
    """Place `size` replicas of `ember serve argv...` on the Ray cluster, then run the router
    on host:port until it stops; returns the exit code."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ember.router.app import RouterConfig, run_router
    from ember.runner.ray_workers import free_resources

    connected = ray.is_initialized()  # by the caller: it stays connected
    if not connected:
        ray.init(address=os.environ.get("RAY_ADDRESS"))  # log_to_driver: the replicas' logs come here
    threads = int(replica_env(0, size, "cpu")["OMP_NUM_THREADS"])  # OMP_NUM_THREADS, else this host's cores / N
    bundle = {"CPU": threads} | ({"GPU": tensor_parallel_size} if device == "cuda" else {})
    group = placement_group([bundle] * size, strategy="SPREAD")
    actors: list = []
    ready = False
    try:
        if not group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
            raise ValueError(f"the Ray cluster cannot place {size} data-parallel replicas of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S} s: it has {free_resources()} free; lower --data-parallel-size "
                             "(or OMP_NUM_THREADS, the CPUs a replica takes) or add nodes")
        replica = ray.remote(Replica)
        actors = [replica.options(num_cpus=threads, num_gpus=bundle.get("GPU", 0),
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(
                                      group, placement_group_bundle_index=i)).remote(argv, i, threads, size)
                  for i in range(size)]
        try:
            replicas = ray.get([a.wait_ready.remote(ready_timeout) for a in actors])
        except ray.exceptions.RayTaskError as e:  # the replica's own error: why it did not start
            raise e.cause if isinstance(e.cause, RuntimeError) else RuntimeError(str(e)) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"a data-parallel replica's Ray actor died before it was ready: {e}") from None
        ready = True
        urls = tuple(r.pop("url") for r in replicas)
        logger.info("data parallel on Ray: %d replicas ready at %s; the router listens on %s:%d", size,
                    ", ".join(urls), host, port)
        run_router(RouterConfig(urls, worker_info=dict(zip(urls, replicas))), host, port, log_level)
        return 0
    finally:
        _stop(actors, graceful=ready)
        remove_placement_group(group)
        if not connected:
            ray.shutdown()


def _stop(actors: list, graceful: bool) -> None:
    """The actors go; `graceful`: each replica drains and exits first (a replica still starting
    would take its stop call only once its start returns: its server dies with its actor)."""
    import ray

    try:
        if graceful:
            ray.get([a.stop.remote() for a in actors], timeout=STOP_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as e:
        logger.warning("data-parallel replicas did not all stop cleanly (%s): their actors are killed", e)
    for a in actors:
        ray.kill(a)
