"""EngineCore: the step loop. schedule -> execute -> update."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.loader.tokenizer import Tokenizer
from ember.request import Request, RequestStatus
from ember.runner.model_runner import ModelRunner, ModelRunnerOutput, PromptLogprobs
from ember.runner.sampler import TokenLogprobs
from ember.scheduler.block_pool import BlockPool
from ember.scheduler.prefix_cache import make_prefix_cache
from ember.scheduler.scheduler import Scheduler
from ember.structured.manager import StructuredOutputManager
from ember.structured.registry import make_backend

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # how long an otherwise idle step waits for a grammar to compile


@dataclass
class EngineCoreOutput:
    """What one step did for one request."""

    request: Request
    new_token_ids: list[int]  # the sampled token, then any that jump-forward appended
    finished: bool
    logprobs: list[TokenLogprobs] | None = None  # one per new token
    prompt_logprobs: PromptLogprobs | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.block_pool = BlockPool(self.runner.num_blocks)
        self.prefix_cache = make_prefix_cache(config.enable_prefix_caching, self.block_pool, config.block_size)
        self.scheduler = Scheduler(self.block_pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len, config.scheduling_policy,
                                   self.prefix_cache)
        vocab_size = config.model_config.vocab_size  # the logits' width: what the bitmask covers
        self.structured = StructuredOutputManager(
            lambda: make_backend(config.structured_outputs_backend, tokenizer, vocab_size), tokenizer, vocab_size,
            config.max_model_len, config.structured_outputs_jump_forward)

    def add_request(self, request: Request) -> None:
        """Queue a request; a constrained one waits outside the scheduler until its grammar compiles."""
        if request.request_id in self.scheduler.requests or self.structured.is_compiling(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.scheduler.check_request(request)
        if not self.structured.add(request):
            self.scheduler.add_request(request)

    def check_request(self, request: Request) -> None:
        """Raise ValueError for a request this engine can never serve; safe from any thread."""
        self.scheduler.check_request(request)
        self.structured.validate(request.sampling_params)

    def abort_request(self, request_id: str) -> None:
        if self.structured.abort(request_id) is not None:
            return
        for req in self.scheduler.abort(request_id):
            self._release(req.request_id)

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
        assert not self.structured.holds(), "the structured-output manager still holds requests"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.num_compiling > 0

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        admitted = self._admit_compiled()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if not admitted:  # only grammars still compiling: wait for one, not spin
                self.structured.wait(GRAMMAR_WAIT_S)
            return admitted
        t1 = time.perf_counter()
        result = self.runner.execute(plan, lambda: self.structured.bitmasks(plan))
        t2 = time.perf_counter()
        stepped, finished = self.scheduler.update(plan, result.sampled)
        new_tokens = {req.request_id: [req.output_token_ids[-1]] for req in stepped}
        for req in stepped:
            if not req.status.is_finished:
                new_tokens[req.request_id] += self._follow_grammar(req, finished)
        if self.runner.profile_steps:
            times = self.runner.step_times
            times["schedule"] += t1 - t0
            times["update"] += time.perf_counter() - t2
            times["steps"] += 1
        for req in finished:
            self._release(req.request_id)
        return admitted + [self._output(req, result, new_tokens[req.request_id]) for req in stepped] + [
            EngineCoreOutput(c.request, [], False, prompt_logprobs=result.prompt_logprobs[c.request.request_id])
            for c in plan.chunks if c.request.request_id in result.prompt_logprobs and not c.samples]

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
                outputs.append(EngineCoreOutput(req, forced, False))
        for req in failed:
            req.finish("abort", status=RequestStatus.ABORTED)
            outputs.append(EngineCoreOutput(req, [], True))
        return outputs

    def _follow_grammar(self, req: Request, finished: list[Request]) -> list[int]:
        """Feed a constrained request's new token to its grammar: finish it when the grammar
        is complete, else append what the grammar forces next (returned)."""
        advance = self.structured.advance(req)
        if advance is None:
            return []
        if not advance.accepted:
            logger.error("request %s: the grammar refused sampled token %d", req.request_id, req.output_token_ids[-1])
            self.scheduler.finish(req, "abort", status=RequestStatus.ABORTED)
        elif advance.terminated:
            self.scheduler.finish(req, "stop")
        else:
            for token in advance.forced:
                req.append_token(token)
            return advance.forced
        finished.append(req)
        return []

    def _output(self, req: Request, result: ModelRunnerOutput, new_tokens: list[int]) -> EngineCoreOutput:
        logprobs = result.logprobs.get(req.request_id)
        return EngineCoreOutput(req, new_tokens, req.status.is_finished,
                                [logprobs] if logprobs is not None else None,
                                result.prompt_logprobs.get(req.request_id))
