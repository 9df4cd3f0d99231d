"""EngineCore: the step loop. schedule -> launch -> update.

With async scheduling (vLLM's; on by default for CUDA) one launched step stays in flight
across calls: step N+1 is scheduled and launched while the device computes step N, and
N's tokens are applied after that. The tokens are those of the synchronous loop: a
request whose last token is pending gets it on the device (see ModelRunner._prepare),
seeded generators draw in the same order, and a request that finishes at N drops the
token N+1 computed for it. Per step the engine falls back to collecting first (a
synchronous step) when the next schedule needs the in-flight tokens on the CPU: see
`_needs_tokens_first`, and `_drafts_need_tokens` for speculative decoding (a step that
verifies drafts or whose requests are asked for their next drafts; above
disable_by_batch_size neither happens and the steps run async).

A failure in one request's own work (its sampling row, its grammar's mask or advance,
its text in the output processor) fails that request alone: `fail_request` ends it (and
its forked samples) with finish_reason "error" and a message for its client, and the next
`step()` hands back its final output. Anything else that raises out of `step()` is the
engine's own failure.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.engine.beam_groups import BeamGroups, BeamResult
from ember.engine.stats import EngineStats
from ember.loader.tokenizer import Tokenizer
from ember.request import Request, RequestStatus
from ember.runner.model_runner import LaunchedStep, ModelRunner, ModelRunnerOutput, PromptLogprobs
from ember.runner.sampler import TokenLogprobs
from ember.runner.tensor_parallel import WorkerFailed
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.host_tier import HostKVTier
from ember.scheduler.prefix_cache import make_prefix_cache
from ember.scheduler.scheduler import Scheduler, SchedulerOutput
from ember.scheduler.sliding_window import shared_window
from ember.scheduler.state_snapshots import StateSnapshots
from ember.scheduler.swap_space import SwapSpace
from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.proposer import Drafts
from ember.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an otherwise idle step waits for a grammar to compile


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did for one request: plain data (it crosses the process boundary), only
    what is new since the last output."""

    request_id: str  # the sample's own id (a forked sample's is "<id>#<index>")
    new_token_ids: list[int]  # the sampled token, then any that jump-forward appended
    finished: bool
    logprobs: list[TokenLogprobs] | None = None  # one per new token
    prompt_logprobs: PromptLogprobs | None = None
    pooled: list[float] | None = None  # runner="pooling": the prompt's vector (the request ends with it)
    parent_id: str | None = None  # a forked sample's request as added
    index: int = 0  # which of the request's n samples
    finish_reason: str | None = None  # with finished
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": what its client is told
    num_cached_tokens: int | None = None  # its prefix-cache hit at first admission
    scheduled_time: float | None = None  # with finished: when it was first scheduled (time.monotonic())
    first_token_time: float | None = None  # with finished
    cumulative_logprob: float | None = None  # a beam search's hypothesis: its summed log-probabilities


def core_output(req: Request, new_token_ids: list[int], finished: bool | None = None, **fields) -> EngineCoreOutput:
    """`req`'s output of this step (finished: as its status says, unless given)."""
    finished = req.status.is_finished if finished is None else finished
    out = EngineCoreOutput(req.request_id, new_token_ids, finished,
                           parent_id=req.parent.request_id if req.parent is not None else None, index=req.index,
                           num_cached_tokens=req.num_cached_tokens, **fields)
    if finished:
        out.finish_reason, out.stop_reason, out.error = req.finish_reason, req.stop_reason, req.error
        out.scheduled_time, out.first_token_time = req.first_scheduled_time, req.first_token_time
    return out


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        if config.distributed_executor_backend == "ray":
            from ember.runner.ray_workers import RayTensorParallelRunner

            self.runner = RayTensorParallelRunner(config)
        elif config.tensor_parallel_size > 1 or config.distributed_executor_backend == "mp":
            from ember.runner.tensor_parallel import TensorParallelRunner

            self.runner = TensorParallelRunner(config)
        else:
            self.runner = ModelRunner(config)
        if self.runner.max_num_seqs != config.max_num_seqs:  # a defaulted seat count the KV pool lowered
            self.config = config = dataclasses.replace(config, max_num_seqs=self.runner.max_num_seqs)
        self.block_pool = BlockPool(self.runner.num_blocks)
        self.prefix_cache = make_prefix_cache(config.enable_prefix_caching, self.block_pool, config.block_size)
        # recurrent layers: a hit resumes from a snapshot of their state (scheduler/state_snapshots.py)
        snapshots = None
        if config.enable_prefix_caching and config.model_config.linear_layers is not None:
            snapshots = StateSnapshots(self.runner.num_state_snapshots, config.block_size)
        host = HostKVTier(self.runner.num_host_blocks) if self.runner.num_host_blocks else None  # the host tier
        swap = SwapSpace(self.runner.num_swap_blocks) if config.preemption_mode != "recompute" else None
        self.scheduler = Scheduler(self.block_pool, config, self.prefix_cache,
                                   shared_window(config.model_config.layer_windows), snapshots, host, swap,
                                   copy_stream=config.device == "cuda")  # runner/kv_copies.py
        self.kv_loads = 0  # steps that copied KV in from host memory, since start
        self.kv_load_seconds = 0.0  # and how long those copies took
        self.structured = StructuredOutputManager.for_config(config, tokenizer)
        self.in_flight: deque[LaunchedStep] = deque()  # queued on the device, not yet collected
        self._failed: list[EngineCoreOutput] = []  # requests failed since the last step, for step() to hand back
        self.max_in_flight = 1 if config.async_scheduling else 0  # launched steps left running after step()
        self.proposer: Drafts | None = None  # speculative decoding's drafts (spec_decode/)
        spec = config.speculative_config
        if spec is not None and spec.method in ("draft_model", "eagle3"):
            self.proposer = self.runner  # the drafter runs beside the target (runner/draft_model.py, eagle3.py)
        elif spec is not None:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.beams = BeamGroups(self.scheduler)  # the beam searches running (engine/beam_groups.py)
        self.sleeping = 0  # the sleep level (0: awake)

    def add_request(self, request: Request) -> None:
        """Queue a request; a constrained one waits outside the scheduler until its grammar compiles."""
        if self.sleeping:
            raise ValueError("the engine is asleep: wake it up first (POST /wake_up)")
        if request.request_id in self.scheduler.requests or self.structured.is_compiling(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_request(request)
        if not self.structured.add(request):
            self.scheduler.add_request(request)
        if request.beam is not None:
            self.beams.add(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError for a request this engine can never serve; safe from any thread."""
        self.scheduler.check_request(request)
        self.structured.validate(request.sampling_params)

    def abort_request(self, request_id: str) -> None:
        if self.structured.abort(request_id) is not None:
            return
        for req in self.scheduler.abort(request_id):
            self._release(req.request_id)
        self.beams.drop(request_id)

    def request_ids(self) -> list[str]:
        """Every request it holds: scheduled or waiting (forked samples too), or compiling a grammar."""
        return [*self.scheduler.requests, *self.structured.compiling_ids()]

    def fail_request(self, request_id: str, message: str) -> None:
        """End a request and its samples with finish_reason "error" (`message` is what its
        client is told); the next step() returns their final outputs."""
        req = self.scheduler.requests.get(request_id)
        root = req.parent.request_id if req is not None and req.parent is not None else request_id
        compiling = self.structured.abort(root)
        if compiling is not None:
            self._failed.append(self._failed_output(compiling, message))
        ended = self.scheduler.abort(root, "error", RequestStatus.FAILED)
        for r in ended:
            self._release(r.request_id)
        search = self.beams.groups.pop(root, None)
        if search is not None:  # one output for the search, not one a beam
            search.root.finish("error", status=RequestStatus.FAILED)
            ended = [search.root]
        self._failed += [self._failed_output(r, message) for r in ended]

    @staticmethod
    def _failed_output(req: Request, message: str) -> EngineCoreOutput:
        """The final output of a request that failed (out of the scheduler already)."""
        logger.error("request %s failed: %s", req.request_id, message)
        if not req.status.is_finished:
            req.finish("error", status=RequestStatus.FAILED)
        req.error = message
        return core_output(req, [], True)

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        """End a request that its stop string ended (found on the text, outside the core)."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "stop", stop_reason)
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        self.runner.release(request_id)
        self.structured.release(request_id)

    def check_idle(self) -> None:
        """Assert that nothing is left behind: no request, no KV block in use (cached ones
        may stay, evictable), no generator."""
        pool = self.block_pool
        pool.check_integrity()
        self.prefix_cache.check_integrity()
        assert pool.num_in_use == 0, f"{pool.num_in_use} KV blocks still held"
        assert not (self.scheduler.waiting or self.scheduler.running or self.scheduler.requests), \
            "the scheduler still holds requests"
        assert not self.runner.generators, "a seeded request's generator outlived it"
        assert not self.runner.biases, "a request's logit_bias tensors outlived it"
        states = getattr(self.runner, "states", None)
        assert states is None or not states.num_in_use, f"{states.num_in_use} recurrent-state slots still held"
        snapshots = self.scheduler.snapshots
        snapshots.check_integrity(pool.cached)
        assert not snapshots.held_for(), f"state snapshots kept for requests that left: {snapshots.held_for()}"
        assert self.runner.pooler is None or not self.runner.pooler.partial, "a request's pooling state outlived it"
        images = getattr(self.runner, "images", None)
        assert images is None or not images.cache.held, f"image embeddings held for requests that left: " \
            f"{sorted(images.cache.held)}"
        mrope = getattr(self.runner, "mrope", None)
        assert mrope is None or not mrope.requests, f"M-RoPE positions kept for requests that left: " \
            f"{sorted(mrope.requests)}"
        assert not self._failed, "a failed request's output was never handed back"
        assert not self.structured.holds(), "the structured-output manager still holds requests"
        assert not (self.in_flight or self.scheduler.in_flight), "a launched step was never collected"
        if hasattr(self.runner, "check_idle"):  # tensor parallelism: what each rank keeps
            self.runner.check_idle()

    def shutdown(self) -> None:
        """Stop what the runner started outside this process (tensor-parallel workers)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def stats(self) -> EngineStats:
        """A snapshot of the engine's state (what /metrics and the log line show)."""
        sched, pool = self.scheduler, self.block_pool
        return EngineStats(num_running=len(sched.running),
                           num_waiting=len(sched.waiting) + self.structured.num_compiling,  # and those compiling
                           num_kv_blocks=pool.num_blocks, num_kv_blocks_in_use=pool.num_in_use,
                           num_preemptions=sched.num_preemptions, prefix_cache_queries=sched.prefix_cache_queries,
                           prefix_cache_hits=sched.prefix_cache_hits, spec_num_drafts=sched.spec.num_drafts,
                           spec_num_draft_tokens=sched.spec.num_draft_tokens,
                           spec_num_accepted_tokens=sched.spec.num_accepted_tokens,
                           spec_accepted_per_position=tuple(sched.spec.accepted_per_position),
                           sleep_level=self.sleeping, **self._host_stats())

    def _host_stats(self) -> dict[str, int | float]:
        host = self.scheduler.host
        loads = dict(kv_loads=self.kv_loads, kv_load_seconds=self.kv_load_seconds)
        if host is None:
            return loads
        block = self.runner.kv_cache_bytes // self.runner.num_blocks  # a block of every layer (one rank's)
        return dict(host_hit_tokens=self.scheduler.host_hit_tokens, host_bytes_to_host=host.num_offloaded * block,
                    host_bytes_to_device=host.num_onloaded * block, **loads)

    # -- operations (the server's /reset_prefix_cache, /start_profile, /sleep, ...) ------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (vLLM's /reset_prefix_cache); False, changing nothing, while
        a request runs or waits (it may hold or be about to hit cached blocks)."""
        if self.has_unfinished_requests():
            return False
        if self.block_pool.num_evictable:
            self.prefix_cache.evict(self.block_pool.num_evictable)
        return True

    def start_profile(self, folder: str) -> None:
        """Record the torch profiler (CPU, and CUDA where the model runs there) until stop_profile."""
        import torch

        if getattr(self, "_profiler", None) is not None:
            raise ValueError("a profile is already being recorded: POST /stop_profile first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if getattr(self.runner, "device", None) is not None and self.runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profile_folder = folder
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop the profile start_profile began; the path of its Chrome trace."""
        import os
        from pathlib import Path

        profiler = getattr(self, "_profiler", None)
        if profiler is None:
            raise ValueError("no profile is being recorded: POST /start_profile first")
        self._profiler = None
        profiler.stop()
        folder = Path(self._profile_folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"ember-core-{os.getpid()}-{time.time_ns()}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        return str(path)

    def sleep(self, level: int) -> None:
        """Free the KV pool (level 1) and the weights too (level 2), for an RL loop's trainer to
        use the memory; wake_up restores them (the weights read from the model's files again)
        with the prefix cache empty. Only while no request runs or waits."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (the KV pool) or 2 (the KV pool and the weights); got {level}")
        if self.sleeping:
            raise ValueError("the engine is asleep already: POST /wake_up first")
        if not isinstance(self.runner, ModelRunner):
            raise ValueError("sleep is not supported with tensor parallelism")
        if self.has_unfinished_requests():
            raise ValueError("requests are running or waiting: sleep once they are done")
        self.reset_prefix_cache()
        if self.scheduler.host is not None:  # the evicted blocks' copies would read the freed pool
            self.scheduler.host.drop_offloads()
        self.runner.sleep(level)
        self.sleeping = level

    def wake_up(self) -> None:
        if not self.sleeping:
            raise ValueError("the engine is awake")
        self.runner.wake_up()
        self.sleeping = 0

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self.structured.num_compiling > 0 or bool(self.in_flight)
                or bool(self._failed))

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step; hand back the tokens of the steps collected here:
        this one when synchronous, else the one launched by the call before (the first
        call hands back none; a call with nothing to launch collects what is in flight),
        and the final outputs of requests that failed meanwhile."""
        outputs = self._step()
        failed, self._failed = self._failed, []
        return outputs + failed

    def _step(self) -> list[EngineCoreOutput]:
        outputs = self._admit_compiled()
        if self.in_flight and (_needs_tokens_first(self.in_flight[-1].plan)
                               or self._drafts_need_tokens(self.in_flight[-1].plan)):
            outputs += self._collect()
        plan = self._timed("schedule", self.scheduler.schedule)
        if plan.is_empty and not plan.has_copies:
            if self.in_flight:
                return outputs + self._collect()
            if self.beams.groups and self.beams.unblock():  # held beams took what the waiting need
                return outputs
            if not outputs:  # only grammars still compiling: wait for one, not spin
                self.structured.wait(GRAMMAR_WAIT_S)
            return outputs
        self.in_flight.append(self._dropping_on_failure(self.runner.launch, plan,
                                                       lambda: self.structured.bitmasks(plan)))
        self.scheduler.mark_launched(plan)  # its tokens count as computed, the sampled ones as pending
        for request_id, message in self.structured.take_failures().items():  # a mask that failed
            self.fail_request(request_id, message)
        while len(self.in_flight) > self.max_in_flight:
            outputs += self._collect()  # with async scheduling: the previous step, while this one runs
        return outputs

    def finish_in_flight(self) -> list[EngineCoreOutput]:
        """Collect the launched steps still in flight (their outputs are returned)."""
        outputs = []
        while self.in_flight:
            outputs += self._collect()
        return outputs

    def _collect(self) -> list[EngineCoreOutput]:
        """Wait for the oldest launched step and apply its tokens."""
        launched = self.in_flight.popleft()
        result = self._dropping_on_failure(self.runner.collect, launched)
        return self._timed("update", self._apply, launched.plan, result)

    def _dropping_on_failure(self, runner_call, *args):
        """runner_call(*args); when the tensor-parallel workers are gone, the steps in flight
        cannot be collected either: they are dropped, so the error raised is the one that names
        the worker, not a later collect's (LLM.generate collects in its cleanup)."""
        try:
            return runner_call(*args)
        except WorkerFailed:
            self.in_flight.clear()
            raise

    def _apply(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """A step's tokens: append, stop checks, forks, grammars; release what finished.
        Requests that left while it ran get nothing, nor do those whose row failed (they fail)."""
        for request_id in result.failed:
            result.sampled.pop(request_id, None)
        if result.kv_load_seconds is not None:
            self.kv_loads += 1
            self.kv_load_seconds += result.kv_load_seconds
        # a verifying chunk appends the run of tokens it accepted, any other one token
        had = {c.request.request_id: len(c.request.output_token_ids) for c in plan.chunks if c.draft_token_ids}
        stepped, finished = self.scheduler.update(plan, result.sampled)
        pooled = self._finish_pooled(result.pooled)
        new_tokens = {req.request_id: req.output_token_ids[had.get(req.request_id, len(req.output_token_ids) - 1):]
                      for req in stepped}  # none with max_tokens=0
        num_sampled = {request_id: len(tokens) for request_id, tokens in new_tokens.items()}
        for req in stepped:
            if not req.status.is_finished:
                new_tokens[req.request_id] += self._follow_grammar(req, finished, num_sampled[req.request_id])
        for req in finished:
            self._release(req.request_id)
        for request_id, message in result.failed.items():
            self.fail_request(request_id, message)
        searched = []
        if self.beams.groups:
            results, left = self.beams.step(stepped, result.logprobs)
            for req in left:
                self._release(req.request_id)
            searched = [_beam_output(r) for r in results]
        if self.proposer is not None:
            self._propose(stepped)
        return pooled + searched + [self._output(req, result, new_tokens[req.request_id], num_sampled[req.request_id])
                                    for req in stepped if req.beam is None] + [
            core_output(c.request, [], False, prompt_logprobs=result.prompt_logprobs[c.request.request_id])
            for c in plan.chunks if c.request.request_id in result.prompt_logprobs and not c.samples
            and not c.request.status.is_finished]

    def _finish_pooled(self, pooled: dict[str, list[float]]) -> list[EngineCoreOutput]:
        """End the requests whose prompt gave its pooled vector (those still there)."""
        outputs = []
        for request_id, vector in pooled.items():
            req = self.scheduler.requests.get(request_id)
            if req is not None:
                self.scheduler.finish(req, "stop")
                self._release(request_id)
                outputs.append(core_output(req, [], True, pooled=vector))
        return outputs

    def _timed(self, phase: str, fn, *args):
        """fn(*args), its seconds added to the runner's step_times[phase] when profiling."""
        start = time.perf_counter()
        result = fn(*args)
        if self.runner.profile_steps:
            self.runner.step_times[phase] += time.perf_counter() - start
        return result

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar is ready to the scheduler (with the tokens their grammar
        forces at the start); end those whose grammar failed."""
        if not self.structured.num_compiling:
            return []
        ready, failed = self.structured.ready()
        outputs = []
        for req, forced in ready:
            for token in forced:
                req.append_token(token)
            self.scheduler.add_request(req)
            if forced:
                outputs.append(core_output(req, forced, False))
        outputs += [self._failed_output(req, message) for req, message in failed]
        return outputs

    def _follow_grammar(self, req: Request, finished: list[Request], num_new: int) -> list[int]:
        """Feed a constrained request's `num_new` new tokens to its grammar: finish it when the
        grammar is complete, fail it when the grammar refuses a token, else append what the
        grammar forces next (returned)."""
        advance = self.structured.advance(req, num_new)
        if advance is None:
            return []
        if not advance.accepted:
            self.fail_request(req.request_id, advance.error or
                              f"the output constraint refused sampled token {req.output_token_ids[-1]}")
        elif advance.terminated:
            self.scheduler.finish(req, "stop")
            finished.append(req)
        else:
            for token in advance.forced:
                req.append_token(token)
            return advance.forced
        return []

    def _output(self, req: Request, result: ModelRunnerOutput, new_tokens: list[int],
                num_sampled: int) -> EngineCoreOutput:
        """`new_tokens`: the `num_sampled` tokens the step sampled (with logprobs, where asked),
        then those a grammar forced."""
        logprobs = result.logprobs.get(req.request_id) if num_sampled else None
        return core_output(req, new_tokens, logprobs=logprobs[:num_sampled] if logprobs is not None else None,
                           prompt_logprobs=result.prompt_logprobs.get(req.request_id))

    def _drafting(self) -> bool:
        """Whether requests are asked for drafts now: not while more of them run than
        disable_by_batch_size."""
        limit = self.config.speculative_config.disable_by_batch_size
        return limit is None or len(self.scheduler.running) <= limit

    def _drafts_need_tokens(self, plan: SchedulerOutput) -> bool:
        """Speculative decoding's part of the per-step fallback: a launched step is collected
        before the next schedule when it verifies drafts (how many tokens it keeps is known at
        its update only) or when its update asks its requests for their next drafts (a proposer
        reads the accepted tokens on the CPU). A step of neither (drafting off above
        disable_by_batch_size) runs async; should the count fall meanwhile, the update asks only
        the requests no later step computes for (`_propose`).
        Drafting inside the step (vLLM's padded drafting: one wait a step) was built and measured
        slower at SmolLM2's size, where the host's operations a step, not its waits, set the pace
        (benchmarks/BENCHMARKS.md, 2026-12-07 last; the branch spec-inlaunch keeps it)."""
        if self.proposer is None:
            return False
        return any(c.draft_token_ids for c in plan.chunks) or (self._drafting() and any(c.samples for c in plan.chunks))

    def _propose(self, stepped: list[Request]) -> None:
        """Speculative decoding: the drafts each running request's next step verifies (a
        constrained one's as far as its grammar accepts them; none while more requests run than
        disable_by_batch_size, nor for a request a later launched step computes for: its drafts
        would follow a token not known yet)."""
        spec = self.config.speculative_config
        for req in stepped:
            req.draft_token_ids = []
        if not self._drafting():
            return
        asking = [req for req in stepped if not req.status.is_finished and not req.num_steps_in_flight]
        for req in asking:
            self.scheduler.reserve_lookahead(req, spec.lookahead_slots)
        for req, drafts in zip(asking, self.proposer.propose_for(asking) if asking else []):
            if drafts and req.sampling_params.structured_outputs is not None:
                drafts = self.structured.draftable(req, drafts)
            req.draft_token_ids = drafts


def _needs_tokens_first(plan: SchedulerOutput) -> bool:
    """Whether the next schedule must wait for this launched step's tokens (a synchronous
    step), decided per step: it ran short of KV blocks (the next schedule may preempt,
    which never happens while a step is in flight), it swaps requests out (those it
    preempted for wait for the blocks its collection gives back), or it samples for a
    request whose next step needs this token on the CPU: a grammar advances on it (its mask, forced tokens),
    penalties, min_tokens, bad words of several tokens and a thinking budget read the output
    so far, and n > 1 forks at the first sample.
    Stop strings, aborts, logprobs and seeds need no fallback: a request that leaves while
    a step computes for it just drops that step's token."""
    return (plan.short_of_blocks or bool(plan.swap_outs)
            or any(_needs_last_token(c.request) for c in plan.chunks if c.samples))


def _beam_output(result: BeamResult) -> EngineCoreOutput:
    """A finished beam search's hypothesis `index`, as the output of that sample of its request."""
    root, i = result.root, result.index
    return EngineCoreOutput(root.request_id if i == 0 else root.child_id(i), result.token_ids, True,
                            parent_id=root.request_id if i else None, index=i, finish_reason=result.finish_reason,
                            num_cached_tokens=root.num_cached_tokens, scheduled_time=root.first_scheduled_time,
                            first_token_time=root.first_token_time, cumulative_logprob=result.cumulative_logprob)


def _needs_last_token(req: Request) -> bool:
    p = req.sampling_params
    return (req.beam is not None or p.structured_outputs is not None or len(req.output_token_ids) < p.min_tokens
            or req.num_samples_to_draw > 1 or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0 or any(len(ids) > 1 for ids in p.bad_words_token_ids or ())
            or p.thinking_token_budget is not None)
