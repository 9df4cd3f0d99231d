"""Request: one sequence the engine generates for, and its bookkeeping."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from ember.multimodal.inputs import ImageFeature, cache_keys
from ember.sampling_params import BeamSearchParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"  # finish_reason "error": something in the engine failed for this request alone

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.FAILED)


@dataclass(eq=False)  # identity: a queue removes the very request, not one of equal fields
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first under the "priority" policy (vLLM's convention)
    cache_salt: str | None = None  # the prefix cache shares blocks only among requests of one salt
    token_type_ids: list[int] | None = None  # an encoder's segment of each prompt token (a pair's second text: 1)
    mm_features: list[ImageFeature] | None = None  # its images, in prompt order (their placeholder tokens)
    parent: Request | None = None  # set on the samples 1..n-1 forked from a request with n > 1
    index: int = 0  # which of the parent's n samples this is
    # beam search (engine/beam_groups.py): the search every beam of the request follows (its beams
    # are forks of it: `parent`); `held`: a beam whose token of this step waits for its group's others
    beam: BeamSearchParams | None = None
    held: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or being written by a launched step)
    # async scheduling: tokens that launched steps sample for it and the CPU does not know
    # yet (placeholders: they count in num_tokens, not in output_token_ids), and how many
    # launched, not yet collected steps compute for it (its blocks stay while any does)
    num_pending_tokens: int = 0
    num_steps_in_flight: int = 0
    # speculative decoding: the tokens a proposer guessed to follow output_token_ids, verified by
    # its next decode step (not part of the sequence until accepted)
    draft_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_blocks_in_cache: int = 0  # leading block_ids that the prefix cache holds
    # leading block_ids the request gave back, as no query of it can see them again (sliding
    # window): they point at the null block; it holds block_ids[num_released_blocks:]
    num_released_blocks: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission (vLLM's name)
    times_passed_over: int = 0  # later arrivals admitted first (bounds the lpm policy)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # with finish_reason "error": what its client is told
    num_preemptions: int = 0
    # preempted by swap: its blocks' host slots (swap_space.py) and the tokens they hold, until it resumes
    swapped: tuple[list[int], int] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output, counting the pending tokens (async scheduling)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output whose ids the CPU has: len(all_token_ids)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] (0 <= start, 0 <= end) without building all_token_ids: a
        step's few tokens of a long context."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    @property
    def cache_token_ids(self) -> list[int]:
        """all_token_ids as the prefix cache keys them: an image's placeholder tokens by its hash."""
        if not self.mm_features:
            return self.all_token_ids
        return cache_keys(self.prompt_token_ids, self.mm_features) + self.output_token_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def num_samples_to_draw(self) -> int:
        """Tokens its next sampling step draws: all n first tokens at once (it then forks
        into n requests, each a running slot), one after that."""
        return self.sampling_params.n if not self.output_token_ids else 1

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"

    def fork(self, index: int, token_id: int) -> Request:
        """Sample `index` of this request's n: the same prompt and computed tokens, its own
        first token. The caller gives it its blocks."""
        params = dataclasses.replace(self.sampling_params, n=1)
        if params.seed is not None:
            params.seed += index
        child = Request(self.child_id(index), self.prompt_token_ids, params, prompt=self.prompt,
                        eos_token_ids=self.eos_token_ids, arrival_time=self.arrival_time,
                        priority=self.priority, cache_salt=self.cache_salt, parent=self, index=index,
                        mm_features=self.mm_features)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_blocks_in_cache = self.num_blocks_in_cache
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.first_scheduled_time = self.first_scheduled_time
        child.append_token(token_id)
        return child

    def beam_fork(self, request_id: str, token_id: int) -> Request:
        """A new beam that continues this one's tokens before its last with `token_id`. The
        caller gives it its blocks."""
        root = self.parent if self.parent is not None else self
        child = Request(request_id, self.prompt_token_ids, self.sampling_params, prompt=self.prompt,
                        eos_token_ids=self.eos_token_ids, arrival_time=self.arrival_time, priority=self.priority,
                        cache_salt=self.cache_salt, parent=root, mm_features=self.mm_features, beam=self.beam)
        child.output_token_ids = self.output_token_ids[:-1] + [token_id]
        child.num_computed_tokens = self.num_computed_tokens
        child.num_blocks_in_cache = self.num_blocks_in_cache
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.first_scheduled_time, child.first_token_time = self.first_scheduled_time, self.first_token_time
        return child

    def append_token(self, token_id: int) -> None:
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None,
               status: RequestStatus = RequestStatus.FINISHED) -> None:
        self.status, self.finish_reason, self.stop_reason = status, reason, stop_reason
        self.finish_time = time.monotonic()
