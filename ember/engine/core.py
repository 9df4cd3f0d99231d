"""EngineCore: the step loop. schedule -> execute -> update."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.runner.model_runner import ModelRunner, ModelRunnerOutput, PromptLogprobs
from ember.runner.sampler import TokenLogprobs
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import make_prefix_cache
from ember.scheduler.scheduler import Scheduler


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    logprobs: list[TokenLogprobs] | None = None  # one per new token
    prompt_logprobs: PromptLogprobs | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.block_pool = BlockPool(self.runner.num_blocks)
        self.prefix_cache = make_prefix_cache(config.enable_prefix_caching, self.block_pool, config.block_size)
        self.scheduler = Scheduler(self.block_pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len, config.scheduling_policy,
                                   self.prefix_cache)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError for a request this engine can never serve; safe from any thread."""
        self.scheduler.check_request(request)

    def abort_request(self, request_id: str) -> None:
        for req in self.scheduler.abort(request_id):
            self.runner.release(req.request_id)

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        """End a request that its stop string ended (found on the text, outside the core)."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "stop", stop_reason)
            self.runner.release(request_id)

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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(plan)
        t2 = time.perf_counter()
        stepped, finished = self.scheduler.update(plan, result.sampled)
        if self.runner.profile_steps:
            times = self.runner.step_times
            times["schedule"] += t1 - t0
            times["update"] += time.perf_counter() - t2
            times["steps"] += 1
        for req in finished:
            self.runner.release(req.request_id)
        return [self._output(req, result) for req in stepped] + [
            EngineCoreOutput(c.request, [], False, prompt_logprobs=result.prompt_logprobs[c.request.request_id])
            for c in plan.chunks if c.request.request_id in result.prompt_logprobs and not c.samples]

    def _output(self, req: Request, result: ModelRunnerOutput) -> EngineCoreOutput:
        logprobs = result.logprobs.get(req.request_id)
        return EngineCoreOutput(req, [req.output_token_ids[-1]], req.status.is_finished,
                                [logprobs] if logprobs is not None else None,
                                result.prompt_logprobs.get(req.request_id))
