"""Tensor-parallel workers as Ray actors (`distributed_executor_backend="ray"`): the ranks
of runner/tensor_parallel.py's Worker, placed by a placement group (one bundle per rank,
PACK: on one node where it fits, else over several), joined over gloo or NCCL at a store
kept by an actor on rank 0's node.

The engine joins the Ray cluster that RAY_ADDRESS (or `ray.init` before it) names, else
starts one on this machine. Each step's message is put into Ray's object store once, and
each actor reads it from there; rank 0's result comes back. An actor that dies fails the
engine with WorkerFailed naming its rank, and every actor and the placement group go with
the engine.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any

from ember.config import EngineConfig
from ember.distributed.parallel_state import host_rendezvous
from ember.runner.tensor_parallel import (
    READY_TIMEOUT_S,
    TensorParallelRunner,
    Worker,
    WorkerFailed,
    plan_encoder,
    worker_config,
)

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120  # for the cluster to find room for every rank


class Rendezvous:
    """The ranks' meeting point as an actor on rank 0's node (where the ranks meet without Ray,
    and which every rank reaches, as NCCL needs): its store, kept while the actor lives."""

    def __init__(self) -> None:
        import ray

        self.store, self.init_method = host_rendezvous(ray.util.get_node_ip_address())

    def address(self) -> str:
        return self.init_method


class RayTensorParallelRunner(TensorParallelRunner):
    masks_follow = False  # an actor's call cannot wait for the next one: the masks go with the plan

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        size = config.tensor_parallel_size
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        gpu = config.device == "cuda"
        self.group = placement_group([{"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}] * size, strategy="PACK")
        self._dead: str | None = None
        self.actors: list = []
        self._pending: list = []  # the object refs of the messages sent since the last collect
        self.profile_steps, self.step_times, self.pooler = False, defaultdict(float), None
        self.graphs = self.piecewise = None
        self.generators, self.biases = {}, {}  # per-request state lives in the workers: empty here
        self.plans = plan_encoder(config)
        self.images = self.plans.images
        try:
            if not self.group.wait(timeout_seconds=PLACEMENT_TIMEOUT_S):
                raise ValueError(f"the Ray cluster cannot place {size} workers of {self.group.bundle_specs[0]} "
                                 f"within {PLACEMENT_TIMEOUT_S} s: it has {free_resources()} free")

            def on(rank: int) -> PlacementGroupSchedulingStrategy:
                return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)

            self.rendezvous = ray.remote(Rendezvous).options(num_cpus=0, scheduling_strategy=on(0)).remote()
            init_method = self._get([self.rendezvous.address.remote()], READY_TIMEOUT_S, "starting")[0]
            actor = ray.remote(Worker)
            # one CPU (thread) per rank, as its bundle reserves; on CUDA Ray shows each actor its one GPU as 0
            self.actors = [actor.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=on(rank))
                           .remote(worker_config(config), rank, size, init_method, 1, 0)
                           for rank in range(size)]
            ready = self._get([a.sizes.remote() for a in self.actors], READY_TIMEOUT_S, "starting")[0]
        except BaseException:
            self.shutdown()
            raise
        self._take_sizes(ready)
        logger.info("tensor parallel on Ray: %d actors ready, %d KV blocks each", size, self.num_blocks)

    def _send(self, message: tuple) -> None:
        import ray

        self._check()
        ref = ray.put(message)  # once: every actor reads it from the object store
        self._pending = [a.handle.remote(ref) for a in self.actors]

    def _receive(self, timeout: float, doing: str) -> Any:
        self._check()
        return self._get(self._pending, timeout, doing)[0]

    def _get(self, refs: list, timeout: float, doing: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError) as e:
            failed = [rank for rank, ref in enumerate(refs) if _failed(ref)]
            self._dead = (f"tensor-parallel worker {', '.join(f'rank {r}' for r in failed) or 'failed'} "
                          f"(a Ray actor) while {doing}: {type(e).__name__}: {str(e)[:2000]}")
            self._stop()
            raise WorkerFailed(self._dead) from None

    def shutdown(self) -> None:
        self._stop()
        self._dead = self._dead or "shut down"

    def _stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if getattr(self, "group", None) is not None:
            remove_placement_group(self.group)
            self.group = None
        if getattr(self, "rendezvous", None) is not None:
            ray.kill(self.rendezvous)
            self.rendezvous = None


def _failed(ref) -> bool:
    import ray

    done, _ = ray.wait([ref], timeout=0)
    if not done:
        return False
    try:
        ray.get(done[0])
        return False
    except ray.exceptions.RayError:
        return True



def free_resources() -> dict[str, float]:
    """The CPUs and GPUs the Ray cluster has free now (for the errors of a group it cannot place)."""
    import ray

    resources = ray.available_resources()
    return {k: resources.get(k, 0.0) for k in ("CPU", "GPU")}
