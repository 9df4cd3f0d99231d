"""StructuredOutputManager: the engine core's side of structured output.

    add(req)        compile its grammar on a worker thread (cached by key); the request
                    waits here, outside the scheduler, until the grammar is ready
    ready()         requests whose grammar compiled: each gets its matcher (and the
                    tokens the grammar forces at the start: jump-forward)
    bitmasks(plan)  each step, once the forward is queued: the allowed tokens of every
                    constrained row that samples (filled on the CPU)
    advance(req)    after the step: feed the sampled token to the matcher; terminated?
                    and the tokens the grammar now forces (jump-forward)

Jump-forward rule: where the grammar allows one text only (`{"name": "` after `{`), that
text is tokenized with the model's tokenizer and all its tokens but the last are
appended without a forward each: they join the request's tokens, and the next step
computes them like a prefill chunk (num_tokens - num_computed_tokens > 1). The last
token is left to the model, under the mask, because it may merge with what follows
(`"` + `name` is one token `"name`). Every appended token is checked by the matcher, so
the output stays valid. Off for requests that want logprobs (forced tokens have none)
and, at the start, for n > 1 (its first step samples n first tokens).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ember.loader.tokenizer import Tokenizer
from ember.request import Request
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.scheduler.scheduler import SchedulerOutput
from ember.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher, bitmask_words

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used goes first)


@dataclass
class GrammarAdvance:
    """What a request's grammar says after its sampled token."""

    accepted: bool  # False: the grammar forbade the token (the mask makes that a bug)
    terminated: bool = False  # the grammar is complete: the request ends here
    forced: list[int] = field(default_factory=list)  # jump-forward tokens, already accepted


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], tokenizer: Tokenizer | None, vocab_size: int,
                 max_model_len: int, jump_forward: bool = True) -> None:
        """`make_backend` is called once, on the first constrained request: importing a
        grammar package takes a second or two that an engine without one should not pay."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward and tokenizer is not None
        self._pool: cf.ThreadPoolExecutor | None = None  # started on the first constrained request
        self._cache: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._compiling: dict[str, tuple[Request, cf.Future]] = {}
        self._grammars: dict[str, CompiledGrammar] = {}  # per live request (its forks use it too)
        self._matchers: dict[str, GrammarMatcher] = {}
        self.num_forced_tokens = 0  # appended by jump-forward, since start

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # the boundary may ask from another thread than the engine's
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    # -- the boundary ---------------------------------------------------------------------

    def validate(self, params: SamplingParams) -> None:
        """ValueError with the compiler's message for a schema / regex / grammar that cannot compile."""
        if params.structured_outputs is not None:
            self.backend.validate(params.structured_outputs)

    # -- compiling ------------------------------------------------------------------------

    def add(self, req: Request) -> bool:
        """Start compiling a constrained request's grammar; False for a free request."""
        so = req.sampling_params.structured_outputs
        if so is None:
            return False
        self._compiling[req.request_id] = (req, self._compile(so))
        return True

    def _compile(self, so: StructuredOutputsParams) -> cf.Future:
        key = so.key
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")
            future = self._pool.submit(self.backend.compile, so)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def ready(self) -> tuple[list[tuple[Request, list[int]]], list[Request]]:
        """Requests whose grammar is ready, each with the tokens it starts with (jump-forward),
        and those whose compile failed."""
        ready, failed = [], []
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            if future.exception() is not None:
                logger.error("request %s: its grammar failed to compile: %s", request_id, future.exception())
                failed.append(req)
                continue
            grammar: CompiledGrammar = future.result()
            self._grammars[request_id] = grammar
            matcher = self._matchers[request_id] = grammar.matcher()
            forced = self._forced(req, matcher) if req.sampling_params.n == 1 else []
            ready.append((req, forced))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready or `timeout` s pass (when nothing else can run)."""
        if self._compiling:
            cf.wait([f for _, f in self._compiling.values()], timeout, return_when=cf.FIRST_COMPLETED)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request still waiting for its grammar; returns it, or None if not here."""
        entry = self._compiling.pop(request_id, None)
        return entry[0] if entry is not None else None

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def holds(self) -> int:
        """Requests this manager still tracks (0 when the engine is idle)."""
        return len(self._compiling) + len(self._matchers) + len(self._grammars)

    # -- each step ------------------------------------------------------------------------

    def bitmasks(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """request id -> int32 [ceil(vocab / 32)] allowed-token bits, for each constrained
        request that samples this step. Empty when none does (the common, free case)."""
        rows = [c.request.request_id for c in plan.chunks
                if c.samples and c.request.request_id in self._matchers]
        if not rows:
            return {}
        bitmask = torch.empty(len(rows), bitmask_words(self.vocab_size), dtype=torch.int32)
        for i, request_id in enumerate(rows):
            self._matchers[request_id].fill_bitmask(bitmask, i)
        return {request_id: bitmask[i] for i, request_id in enumerate(rows)}

    def advance(self, req: Request) -> GrammarAdvance | None:
        """Feed a request's newly sampled token to its matcher (None: not constrained)."""
        if req.sampling_params.structured_outputs is None:
            return None
        matcher = self._matchers.get(req.request_id)
        if matcher is None:  # a sample forked from a constrained request: its own matcher
            grammar = self._grammars[req.parent.request_id]
            self._grammars[req.request_id] = grammar
            matcher = self._matchers[req.request_id] = grammar.matcher()
        if not matcher.accept_token(req.output_token_ids[-1]):
            return GrammarAdvance(False)
        if matcher.is_terminated():
            return GrammarAdvance(True, terminated=True)
        return GrammarAdvance(True, forced=self._forced(req, matcher))

    def _forced(self, req: Request, matcher: GrammarMatcher) -> list[int]:
        """Jump-forward: the tokens to append now (see the module docstring for the rule)."""
        params = req.sampling_params
        if not self.jump_forward or params.logprobs is not None:
            return []
        text = matcher.jump_forward()
        if not text:
            return []
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:-1]
        # leave room to sample at least one more token before max_tokens / max_model_len
        room = self.max_model_len - req.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(req.output_token_ids) - 1)
        tokens = tokens[:max(room, 0)]
        tokens = tokens[:matcher.accept_tokens(tokens)]
        self.num_forced_tokens += len(tokens)
        return tokens
