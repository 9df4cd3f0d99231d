"""The engine's runner when tensor_parallel_size > 1: one worker process per rank (rank 0
included), each a ModelRunner over its shard of the layers (layers/linear.py,
layers/embedding.py), joined over torch.distributed (gloo on the CPU, NCCL on GPUs 0..N-1).

The scheduler stays in the engine's process. Each step's plan goes to every rank once,
through the shared-memory broadcast (distributed/shm_broadcast.py), as a diff of what the
workers hold (runner/plan_diff.py); its grammar masks follow in a second message, so
the engine fills them while the ranks prepare and queue the forward (on Ray they travel
with the plan). Every rank runs the same forward and sampling, and rank 0 sends back what
it sampled over a pipe. A vision-language model's tower and projector are replicated: every
rank encodes the step's images itself (the tower is small beside the language model, and no
collective runs in it), each image's pixels sent once, when its encoding starts, and every
rank's encoder cache follows the engine's mirror of it (runner/multimodal.py's EncoderCacheMirror). Speculative decoding's drafter (a draft model, an EAGLE-3 head) is
split over the ranks too: after each update every rank gets the requests as they now are
(`propose`, a diff as the plans are) and drafts; rank 0's drafts come back. A worker that dies, or fails, fails the engine with an error that names it; the
others are then stopped, so no process outlives the engine (they are daemons too, and a
worker whose engine is gone stops by itself).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ember.config import EngineConfig
from ember.distributed.parallel_state import gather_to_first, host_rendezvous
from ember.distributed.shm_broadcast import ShmBroadcast
from ember.runner.plan_diff import PlanDecoder, PlanEncoder

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0  # loading a large model's shard, profiling, capturing graphs
STEP_TIMEOUT_S = 3600.0  # a step longer than this is a hang: the engine fails


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or raised: the engine cannot go on."""


@dataclass
class RankGraphs:
    """Rank 0's decode CUDA graphs (runner/cuda_graph.py), as the engine's process sees them."""

    sizes: list[int]
    max_batch: int
    capture_seconds: float
    pool_bytes: int


@dataclass
class _Launched:
    """What the engine keeps of a launched step (LaunchedStep's role): its plan."""

    plan: Any


class TensorParallelRunner:
    masks_follow = True  # the grammar masks come as the message after the plan (see Worker.handle)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        size = config.tensor_parallel_size
        if config.device == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; {torch.cuda.device_count()} are "
                             "visible")
        ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no CUDA or thread state forked
        self.bus = ShmBroadcast(readers=size, slots=8, slot_bytes=4 << 20)
        self.results, child = ctx.Pipe(duplex=False)
        self.rendezvous, init_method = host_rendezvous()
        threads = max(1, torch.get_num_threads() // size)
        args = (worker_config(config), size, init_method, self.bus.handle(), child, threads, os.getpid())
        self.procs = [ctx.Process(target=_worker, name=f"ember-tp{rank}", daemon=True, args=(rank, *args))
                      for rank in range(size)]
        self.profile_steps = False
        # --profile-steps: the engine's side of a step (the ranks' own phases stay in their processes)
        self.step_times: defaultdict[str, float] = defaultdict(float)
        self.pooler, self.graphs, self.piecewise = None, None, None
        self.generators, self.biases = {}, {}  # per-request state lives in the workers: empty here
        self.plans = plan_encoder(config)
        self.images = self.plans.images
        self._dead: str | None = None
        try:
            for p in self.procs:
                p.start()
            child.close()
            self._take_sizes(self._receive(READY_TIMEOUT_S, "starting"))
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks ready, %d KV blocks each; all-reduce: %s", size, self.num_blocks,
                    self.all_reduce)

    # -- the runner's interface (EngineCore) -----------------------------------------------

    def launch(self, plan, fill_grammar_masks: Callable[[], dict[str, torch.Tensor]] | None = None) -> _Launched:
        start = time.perf_counter()
        diff = self.plans.encode(plan)
        fill = fill_grammar_masks or dict
        if self.masks_follow:
            self._send(("launch", diff, None))
            self._send(("masks", fill()))
        else:
            self._send(("launch", diff, fill()))
        if self.profile_steps:
            self.step_times["send"] += time.perf_counter() - start
            self.step_times["steps"] += 1
        return _Launched(plan)

    def collect(self, step: _Launched):
        start = time.perf_counter()
        self._send(("collect",))
        out = self._receive(STEP_TIMEOUT_S, "running a step")
        if self.profile_steps:
            self.step_times["wait"] += time.perf_counter() - start  # the ranks' forward and sampling
        return out

    def propose_for(self, requests: list) -> list[list[int]]:
        """Speculative decoding's drafter runs sharded on every rank, as the target does: each
        gets the requests as they are after the update; rank 0's drafts come back."""
        self._send(("propose", self.plans.encode_requests(requests)))
        return self._receive(STEP_TIMEOUT_S, "drafting")

    def release(self, request_id: str) -> None:
        dropped = self.plans.forget(request_id)
        if self._dead is None:  # dead workers hold nothing: the engine's cleanup after a failure goes on
            self._send(("release", request_id, dropped))

    def check_idle(self) -> None:
        """Assert that no rank keeps anything for a request (they have all left) and that every
        rank's encoder cache holds what the engine's mirror of it holds (EngineCore.check_idle)."""
        self._send(("holdings",))
        for rank, held in enumerate(self._receive(STEP_TIMEOUT_S, "reporting what the ranks hold")):
            assert not held["requests"], f"rank {rank} keeps state for requests that left: {held['requests']}"
            if self.images is not None:
                mirror = self.images.cache
                assert (held["images"], held["image_bytes"]) == (sorted(mirror.entries), mirror.nbytes), \
                    f"rank {rank}'s encoder cache holds {held['images']} ({held['image_bytes']} bytes); the " \
                    f"engine's mirror of it {sorted(mirror.entries)} ({mirror.nbytes} bytes)"

    def shutdown(self) -> None:
        """Stop the workers (idempotent); no process is left behind."""
        if self._dead is None:
            try:
                self.bus.send(("shutdown",), timeout=5, alive=self._all_alive)
            except (RuntimeError, TimeoutError):
                pass
        for p in self.procs:
            if p.pid is None:
                continue  # never started
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.bus.close()
        self.rendezvous = None
        self._dead = self._dead or "shut down"

    # -- plumbing ----------------------------------------------------------------------------

    def _take_sizes(self, ready: dict[str, Any]) -> None:
        """Rank 0's sizes (Worker.sizes; each rank holds about a tensor_parallel_size-th of the
        weights and the KV heads)."""
        self.num_blocks, self.weight_bytes = ready["num_blocks"], ready["weight_bytes"]
        self.activation_bytes, self.kv_cache_bytes = ready["activation_bytes"], ready["kv_cache_bytes"]
        self.max_num_seqs, self.all_reduce = ready["max_num_seqs"], ready["all_reduce"]
        self.num_state_snapshots, self.num_host_blocks = ready["num_state_snapshots"], ready["num_host_blocks"]
        self.num_swap_blocks = ready["num_swap_blocks"]
        self.graphs = RankGraphs(**ready["graphs"]) if ready["graphs"] is not None else None

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _send(self, message: tuple) -> None:
        self._check()
        try:
            self.bus.send(message, timeout=STEP_TIMEOUT_S, alive=self._all_alive)
        except (RuntimeError, TimeoutError) as e:
            self._fail(f"while sending a step: {e}")

    def _receive(self, timeout: float, doing: str) -> Any:
        self._check()
        waited = 0.0
        while not self.results.poll(0.1):
            waited += 0.1
            if not self._all_alive() or waited > timeout:
                self._fail(f"while {doing}" + (f": no answer in {timeout:.0f} s" if waited > timeout else ""))
        kind, payload = self.results.recv()
        if kind == "error":
            self._fail(f"while {doing}:\n{payload}")
        return payload

    def _check(self) -> None:
        if self._dead is not None:
            raise WorkerFailed(f"the tensor-parallel workers are gone ({self._dead})")

    def _fail(self, what: str) -> None:
        for p in self.procs:  # the others end too once a collective loses a rank: name them all
            p.join(2)
        gone = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs) if not p.is_alive()]
        message = f"tensor-parallel worker {', '.join(gone) or 'failed'} {what}"
        self._dead = message
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)
        self.bus.close()
        raise WorkerFailed(message)


def plan_encoder(config: EngineConfig) -> PlanEncoder:
    """The engine's side of the plans; a vision-language model's with its mirror of the ranks'
    encoder caches, whose entries it sizes as the ranks' embeddings are (an image token's row
    and its deepstack rows, in the model's dtype)."""
    vision = config.model_config.vision
    if vision is None:
        return PlanEncoder()
    from ember.runner import multimodal

    row_bytes = vision.text_hidden_size * (1 + len(vision.deepstack_blocks)) * config.torch_dtype.itemsize
    return PlanEncoder(multimodal.EncoderCacheMirror(multimodal.ENCODER_CACHE_BYTES, row_bytes))


def worker_config(config: EngineConfig) -> EngineConfig:
    """The config a worker gets: the request defaults apply where requests come in, not in
    the workers (and their mapping proxy does not pickle)."""
    return dataclasses.replace(config, sampling_defaults={})


class Worker:
    """One rank: its place in the group and its ModelRunner over its shard. `handle` runs
    one of the engine's messages; the same class runs in a process of its own (`_worker`,
    below) or as a Ray actor (runner/ray_workers.py)."""

    def __init__(self, config: EngineConfig, rank: int, size: int, init_method: str, threads: int,
                 gpu: int) -> None:
        from ember.distributed.parallel_state import enable_peer_all_reduce, init_tensor_parallel
        from ember.distributed.peer_all_reduce import MAX_BYTES as PEER_MAX_BYTES
        from ember.runner.model_runner import ModelRunner

        self.rank = rank
        torch.set_num_threads(threads)
        if config.device == "cuda":
            torch.cuda.set_device(gpu)
        init_tensor_parallel(rank, size, "nccl" if config.device == "cuda" else "gloo", init_method)
        # which all-reduce the layers' sums take (before the memory profile: the buffer is the GPU's)
        if size == 1:
            self.all_reduce = "none (one rank)"
        elif config.device != "cuda":
            self.all_reduce = "gloo"
        elif config.disable_custom_all_reduce:
            self.all_reduce = "NCCL (--disable-custom-all-reduce)"
        elif (why := enable_peer_all_reduce(config.torch_dtype)) is not None:
            self.all_reduce = f"NCCL ({why})"
        else:
            self.all_reduce = f"peer memory up to {PEER_MAX_BYTES >> 20} MiB, NCCL above"
        self.runner = ModelRunner(config)
        if self.runner.images is not None:  # it drops what the engine's mirror drops (PlanDiff.dropped_images)
            self.runner.images.cache.max_bytes = None
        self.plans = PlanDecoder()
        self.in_flight: deque = deque()

    def sizes(self) -> dict[str, Any]:
        r, g = self.runner, self.runner.graphs
        graphs = None if g is None else {"sizes": list(g.sizes), "max_batch": g.max_batch,
                                         "capture_seconds": g.capture_seconds, "pool_bytes": g.pool_bytes}
        return {"num_blocks": r.num_blocks, "weight_bytes": r.weight_bytes, "activation_bytes": r.activation_bytes,
                "kv_cache_bytes": r.kv_cache_bytes, "max_num_seqs": r.max_num_seqs, "graphs": graphs,
                "all_reduce": self.all_reduce, "num_state_snapshots": r.num_state_snapshots,
                "num_host_blocks": r.num_host_blocks, "num_swap_blocks": r.num_swap_blocks}

    def handle(self, message: tuple, next_message: Callable[[], tuple] | None = None) -> Any:
        """Rank 0's step output for ("collect",) (every rank computes it, the engine reads
        rank 0's); None otherwise. A launch whose masks are None reads them with
        `next_message()`, as late as the runner asks for them (or once it has launched)."""
        op = message[0]
        if op == "launch":
            _, diff, masks = message
            follow = [] if masks is None else [masks]

            def fill() -> dict[str, torch.Tensor]:
                if not follow:
                    follow.append(next_message()[1])
                return follow[0]

            if diff.dropped_images:
                self.runner.images.cache.drop(diff.dropped_images)
            self.in_flight.append(self.runner.launch(self.plans.decode(diff), fill))
            fill()  # a step that samples nothing never asked: the masks message is read all the same
        elif op == "collect":
            out = self.runner.collect(self.in_flight.popleft())
            return out if self.rank == 0 else None
        elif op == "propose":
            drafts = self.runner.propose_for(self.plans.decode_requests(message[1]))
            return drafts if self.rank == 0 else None
        elif op == "release":  # (the request, the images its leaving evicts from the encoder caches)
            self.plans.forget(message[1])
            self.runner.release(message[1])
            if message[2]:
                self.runner.images.cache.drop(message[2])
        elif op == "holdings":
            return gather_to_first(self.holdings())
        return None

    def holdings(self) -> dict[str, Any]:
        """The requests this rank keeps anything for, and its encoder cache's images (check_idle)."""
        r = self.runner
        requests = set(self.plans.requests) | set(r.generators) | set(r.biases) | set(r.table_rows)
        if r.mrope is not None:
            requests |= set(r.mrope.requests)
        images, image_bytes = [], 0
        if r.images is not None:
            requests |= set(r.images.cache.held)
            images, image_bytes = sorted(r.images.cache.entries), r.images.cache.nbytes
        if r.states is not None and r.states.num_in_use:
            requests.add(f"({r.states.num_in_use} recurrent-state slots)")
        return {"requests": sorted(requests), "images": images, "image_bytes": image_bytes}

    def close(self) -> None:
        from ember.distributed.parallel_state import destroy

        destroy()


def _worker(rank: int, config: EngineConfig, size: int, init_method: str, handle, results, threads: int,
            engine_pid: int) -> None:
    """One rank in a process of its own: a Worker fed by the shared-memory broadcast."""
    def engine_alive() -> bool:
        return os.getppid() == engine_pid

    try:
        worker = Worker(config, rank, size, init_method, threads, gpu=rank)
        bus = ShmBroadcast.attach(handle, rank)
        if rank == 0:
            results.send(("ready", worker.sizes()))
        def next_message() -> tuple:
            return bus.recv(timeout=float("inf"), alive=engine_alive)

        while (message := next_message())[0] != "shutdown":
            out = worker.handle(message, next_message)
            if out is not None:
                results.send(("output", out))
        bus.close()
        worker.close()
    except BaseException:
        try:
            results.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        raise SystemExit(1)
