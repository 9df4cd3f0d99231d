"""EngineCore: the step loop. schedule -> execute -> update."""

from __future__ import annotations

from dataclasses import dataclass

from ember.config import EngineConfig
from ember.request import Request, RequestStatus
from ember.runner.model_runner import ModelRunner
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.scheduler import Scheduler


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.block_pool = BlockPool(self.runner.num_blocks)
        self.scheduler = Scheduler(self.block_pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self.runner.release(request_id)

    def finish_request(self, request_id: str, stop_reason: str) -> None:
        """End a request that its stop string ended (found on the text, outside the core)."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "stop", stop_reason)
            self.runner.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        sampled = self.runner.execute(plan)
        finished = self.scheduler.update(plan, sampled)
        for req in finished:
            self.runner.release(req.request_id)
        return [EngineCoreOutput(c.request, [sampled[c.request.request_id]], c.request.status.is_finished)
                for c in plan.chunks if c.request.request_id in sampled]
