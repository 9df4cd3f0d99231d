"""StructuredOutputManager: the engine core's side of structured output.

    add(req)        compile its grammar on a worker thread (cached by key); the request
                    waits here, outside the scheduler, until the grammar is ready
    ready()         requests whose grammar compiled: each gets its matcher (and the
                    tokens the grammar forces at the start: jump-forward); and the
                    requests that failed, each with the message for its client
    bitmasks(plan)  each step, once the forward is queued: the allowed tokens of every
                    constrained row that samples (filled on the CPU)
    take_failures() request id -> message, for the requests whose mask failed in bitmasks()
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

Reasoning gate (StructuredOutputsParams.reasoning_end): a reasoning model's output begins
with free text that ends with the given token ids (</think>), and only what follows is
constrained. While a request is in its reasoning (`_reasoning`) its rows get no mask,
advance() feeds its matcher nothing, and the tokens its grammar forces at the start wait;
on the step whose token completes the end sequence, advance() hands back those forced
tokens and the matcher takes every token after. Its forks each start in reasoning too.
Whether an output begins in reasoning is the caller's to say (the server asks its
reasoning parser about the prompt: see ember/server/tool_calls.py).

Budgets (the constants below): grammar work runs on the engine thread, so no request may
hold it for long.
  - Jump-forward appends at most MAX_FORCED_CHARS of text / MAX_FORCED_TOKENS tokens per
    call; the rest of a long forced text is simply forced again after the next token.
  - A request whose jump-forward (the backend's call + tokenizing) took longer than
    JUMP_FORWARD_SLOW_S loses jump-forward for the rest of its life (a warning is logged).
  - A request waits at most `compile_timeout_s` for its grammar, then fails. The compile
    cannot be interrupted: it runs on, but a result nobody waits for is not cached.
  - Compiled grammars are cached by key, least recently used out first, bounded by their
    bytes (CACHE_BYTES), not by their count.
(Grammars with a rule that can never end, on which xgrammar's jump-forward would never
return, are refused by the backends' validate() and compile(): see productivity.py.)

Failures: one request's grammar failing never stops the engine. A compile error or a
timeout comes back from ready() as (request, message); an exception from a matcher in
ready() or advance() fails that request (ready(): in the failed list; advance():
GrammarAdvance(False, error=message)); in bitmasks() the row allows every token and the
request goes to take_failures(). The engine core ends such requests with finish_reason
"error". A request whose matcher raised is not touched again (its rows allow everything,
advance() repeats its error) until release().
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ember.config import EngineConfig
from ember.loader.tokenizer import Tokenizer
from ember.request import Request
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.scheduler.scheduler import SchedulerOutput
from ember.structured.base import CompiledGrammar, GrammarBackend, GrammarMatcher, bitmask_words
from ember.structured.registry import make_backend

logger = logging.getLogger(__name__)

# a JSON schema compiles to ~40 KB-2 MB on a 50k-token vocabulary (more on 150k): hundreds
# of grammars fit, and a server pays at most this much RAM for not compiling them again
CACHE_BYTES = 256 << 20
# a compile longer than this is a pathological grammar (typical ones take milliseconds,
# large schemas a second or two): its request fails rather than waiting without end
COMPILE_TIMEOUT_S = 30.0
# forced tokens appended per call: a long forced text (a 5,000-character literal) becomes
# several prefill chunks instead of one huge one; the rest is forced again next step
MAX_FORCED_TOKENS = 256
# forced text tokenized per call: more than MAX_FORCED_TOKENS tokens' worth, and llguidance's
# jump-forward returns up to ~25 KB that it would be waste to tokenize each step
MAX_FORCED_CHARS = 4096
# jump-forward runs on the engine thread every step: a request whose jump-forward took
# longer than this loses it rather than slowing every step. Typical calls take well under
# 1 ms; the margin keeps a loaded machine from turning it off (which changes the tokens)
JUMP_FORWARD_SLOW_S = 0.1

_CacheKey = tuple[str, str]


@dataclass
class GrammarAdvance:
    """What a request's grammar says after its sampled token."""

    accepted: bool  # False: the grammar forbade the token (the mask makes that a bug), or `error`
    terminated: bool = False  # the grammar is complete: the request ends here
    forced: list[int] = field(default_factory=list)  # jump-forward tokens, already accepted
    error: str | None = None  # the matcher raised: the request fails with this message for its client


class _Waiting(NamedTuple):
    """A request waiting for its grammar."""

    request: Request
    future: cf.Future
    deadline: float  # time.monotonic() after which it fails


class _GrammarCache:
    """Compile futures by key, least recently used first, bounded by the compiled grammars'
    bytes (memory_size_bytes plus the key's text). A future counts once it is done and has
    been settled(); a failed or cancelled one is dropped (the next request compiles again)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._futures: OrderedDict[_CacheKey, cf.Future] = OrderedDict()
        self._sizes: dict[_CacheKey, int] = {}  # the settled entries
        self._pending: dict[_CacheKey, cf.Future] = {}  # the entries not yet settled

    def get(self, key: _CacheKey) -> cf.Future | None:
        """The key's future (now the most recently used), or None."""
        future = self._futures.get(key)
        if future is not None:
            self._futures.move_to_end(key)
        return future

    def put(self, key: _CacheKey, future: cf.Future) -> None:
        self.drop(key)
        self._futures[key] = future
        self._pending[key] = future

    def drop(self, key: _CacheKey, future: cf.Future | None = None) -> None:
        """Forget `key` (only if it still maps to `future`, when given)."""
        if key not in self._futures or (future is not None and self._futures[key] is not future):
            return
        del self._futures[key]
        self._pending.pop(key, None)
        self.nbytes -= self._sizes.pop(key, 0)

    def settle(self) -> None:
        """Count the futures that finished, then evict least recently used ones while over budget."""
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            if future.cancelled() or future.exception() is not None:
                self.drop(key)
                continue
            del self._pending[key]
            grammar: CompiledGrammar = future.result()
            self._sizes[key] = grammar.memory_size_bytes + len(key[1])
            self.nbytes += self._sizes[key]
        for key in list(self._futures):
            if self.nbytes <= self.max_bytes:
                break
            if key in self._sizes:
                self.drop(key)


class StructuredOutputManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend], tokenizer: Tokenizer | None, vocab_size: int,
                 max_model_len: int, jump_forward: bool = True, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_bytes: int = CACHE_BYTES) -> None:
        """`make_backend` is called once, on the first constrained request: importing a
        grammar package takes a second or two that an engine without one should not pay."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward and tokenizer is not None
        self.compile_timeout_s = compile_timeout_s
        self._pool: cf.ThreadPoolExecutor | None = None  # started on the first constrained request
        self._cache = _GrammarCache(cache_bytes)
        self._compiling: dict[str, _Waiting] = {}
        self._grammars: dict[str, CompiledGrammar] = {}  # per live request (its forks use it too)
        self._matchers: dict[str, GrammarMatcher] = {}
        self._slow: set[str] = set()  # requests whose jump-forward went over JUMP_FORWARD_SLOW_S: off for them
        self._broken: dict[str, str] = {}  # requests whose matcher raised -> their message (until release)
        self._reasoning: set[str] = set()  # gated requests whose output has not ended its reasoning yet
        self._failures: dict[str, str] = {}  # of those, the ones not reported yet (take_failures)
        self.num_forced_tokens = 0  # appended by jump-forward, since start

    @classmethod
    def for_config(cls, config: EngineConfig, tokenizer: Tokenizer | None) -> StructuredOutputManager:
        """The manager of an engine of `config`: its backend, and masks as wide as the logits."""
        vocab_size = config.model_config.vocab_size  # the logits' width: what the bitmask covers
        return cls(lambda: make_backend(config.structured_outputs_backend, tokenizer, vocab_size), tokenizer,
                   vocab_size, config.max_model_len, config.structured_outputs_jump_forward)

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:  # the boundary may ask from another thread than the engine's
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def warm_up(self) -> None:
        """Import the grammar package and build its vocabulary tables now (a server does
        this at start: the first constrained request would otherwise pay a second or two of
        imports, holding the interpreter lock that the event loop needs). A failure here is
        only logged: constrained requests then get the error themselves."""
        try:
            self.backend.warm_up()
        except Exception:
            logger.warning("the grammar backend could not be prepared: structured output may fail", exc_info=True)

    # -- the boundary ---------------------------------------------------------------------

    def validate(self, params: SamplingParams) -> None:
        """ValueError with the compiler's message for a schema / regex / grammar that cannot
        compile, or whose grammar has a rule that can never end."""
        so = params.structured_outputs
        if so is not None:
            if so.reasoning_end is not None and max(so.reasoning_end) >= self.vocab_size:
                raise ValueError(f"StructuredOutputsParams.reasoning_end must be token ids in [0, {self.vocab_size})")
            self.backend.validate(so)

    # -- compiling ------------------------------------------------------------------------

    def add(self, req: Request) -> bool:
        """Start compiling a constrained request's grammar; False for a free request."""
        so = req.sampling_params.structured_outputs
        if so is None:
            return False
        deadline = time.monotonic() + self.compile_timeout_s
        self._compiling[req.request_id] = _Waiting(req, self._compile(so), deadline)
        return True

    def _compile(self, so: StructuredOutputsParams) -> cf.Future:
        self._cache.settle()
        future = self._cache.get(so.key)
        if future is None or (future.done() and (future.cancelled() or future.exception() is not None)):
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")
            future = self._pool.submit(self.backend.compile, so)
            self._cache.put(so.key, future)
        return future

    def is_compiling(self, request_id: str) -> bool:
        return request_id in self._compiling

    def compiling_ids(self) -> list[str]:
        """The requests waiting for their grammar."""
        return list(self._compiling)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def ready(self) -> tuple[list[tuple[Request, list[int]]], list[tuple[Request, str]]]:
        """Requests whose grammar is ready, each with the tokens it starts with (jump-forward),
        and requests that failed, each with the message for its client: a compile error
        (the compiler's message), a compile that outlived `compile_timeout_s`, or a matcher
        that raised. The failed ones are no longer held here."""
        ready: list[tuple[Request, list[int]]] = []
        failed: list[tuple[Request, str]] = []
        now = time.monotonic()
        for request_id, (req, future, deadline) in list(self._compiling.items()):
            if not future.done():
                if now > deadline:
                    del self._compiling[request_id]
                    self._unwanted(req.sampling_params.structured_outputs, future)
                    message = f"its grammar did not compile within {self.compile_timeout_s:g} s"
                    logger.error("request %s: %s", request_id, message)
                    failed.append((req, message))
                continue
            del self._compiling[request_id]
            error = cf.CancelledError("its compile was cancelled") if future.cancelled() else future.exception()
            if error is not None:
                logger.error("request %s: its grammar failed to compile: %s", request_id, error)
                failed.append((req, str(error) if isinstance(error, ValueError)
                               else f"its grammar failed to compile: {type(error).__name__}: {error}"))
                continue
            grammar: CompiledGrammar = future.result()
            gated = req.sampling_params.structured_outputs.reasoning_end is not None
            try:
                matcher = grammar.matcher()
                forced = self._forced(req, matcher) if req.sampling_params.n == 1 and not gated else []
            except Exception as e:
                logger.exception("request %s: its grammar's matcher failed at the start", request_id)
                self._slow.discard(request_id)
                failed.append((req, _failure_message(e)))
                continue
            self._grammars[request_id] = grammar
            self._matchers[request_id] = matcher
            if gated:
                self._reasoning.add(request_id)
            ready.append((req, forced))
        self._cache.settle()
        return ready, failed

    def _unwanted(self, so: StructuredOutputsParams | None, future: cf.Future) -> None:
        """A compile that no request waits for any more: not cached, and not started if it
        is still queued behind another."""
        if so is None or any(w.future is future for w in self._compiling.values()):
            return
        future.cancel()  # a no-op once it runs: xgrammar cannot be interrupted
        self._cache.drop(so.key, future)

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready or `timeout` s pass (when nothing else can run)."""
        if self._compiling:
            until_deadline = min(w.deadline for w in self._compiling.values()) - time.monotonic()
            cf.wait([w.future for w in self._compiling.values()], max(0.0, min(timeout, until_deadline)),
                    return_when=cf.FIRST_COMPLETED)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request still waiting for its grammar; returns it, or None if not here."""
        waiting = self._compiling.pop(request_id, None)
        return waiting.request if waiting is not None else None

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        self._matchers.pop(request_id, None)
        self._slow.discard(request_id)
        self._broken.pop(request_id, None)
        self._failures.pop(request_id, None)
        self._reasoning.discard(request_id)

    def holds(self) -> int:
        """Requests this manager still tracks (0 when the engine is idle)."""
        return (len(self._compiling) + len(self._matchers) + len(self._grammars) + len(self._slow)
                + len(self._broken) + len(self._reasoning))

    # -- each step ------------------------------------------------------------------------

    def bitmasks(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """request id -> int32 [ceil(vocab / 32)] allowed-token bits, for each constrained
        request that samples this step. Empty when none does (the common, free case).
        A request whose matcher raises gets a row that allows every token and goes to
        take_failures(); the other rows are unaffected."""
        chunks = [c for c in plan.chunks if c.samples and c.request.request_id in self._matchers
                  and c.request.request_id not in self._reasoning]
        if not chunks:
            return {}
        bitmask = torch.empty(sum(1 + len(c.draft_token_ids) for c in chunks), bitmask_words(self.vocab_size),
                              dtype=torch.int32)
        masks, row = {}, 0
        for chunk in chunks:
            request_id, drafts = chunk.request.request_id, chunk.draft_token_ids
            rows = bitmask[row: row + 1 + len(drafts)]
            if request_id not in self._broken:
                try:
                    self._fill_rows(self._matchers[request_id], drafts, bitmask, row)
                except Exception as e:
                    self._failures[request_id] = self._break(request_id, e, "filling its token mask")
                    rows.fill_(-1)  # every bit set: every token allowed
            else:
                rows.fill_(-1)
            masks[request_id] = rows if drafts else rows[0]
            row += 1 + len(drafts)
        return masks

    @staticmethod
    def _fill_rows(matcher: GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, row: int) -> None:
        """The mask of each position a chunk samples: row + j after its drafts[:j] (speculative
        decoding: each drafted position's; the matcher ends where it began)."""
        accepted = 0
        try:
            for j, token in enumerate([*drafts, None]):
                matcher.fill_bitmask(bitmask, row + j)
                if token is not None:
                    if not matcher.accept_token(token):
                        raise RuntimeError(f"draft {token} is not in the grammar (they are checked when drafted)")
                    accepted += 1
        finally:
            if accepted:
                matcher.rollback(accepted)

    def draftable(self, req: Request, drafts: list[int]) -> list[int]:
        """Speculative decoding: the drafts a constrained request can verify, the longest run its
        grammar accepts, short of one that completes it (a gated request in its reasoning, or one
        whose matcher failed: none)."""
        request_id = req.request_id
        matcher = self._matchers.get(request_id)
        if not drafts or matcher is None or request_id in self._reasoning or request_id in self._broken:
            return []
        kept = accepted = 0
        try:
            for token in drafts:
                if not matcher.accept_token(token):
                    break
                accepted += 1
                if matcher.is_terminated():
                    break  # the model samples the grammar's end itself
                kept += 1
        except Exception:
            logger.exception("request %s: checking drafts against its grammar failed: none drafted", request_id)
            kept = 0
        finally:
            if accepted:
                matcher.rollback(accepted)
        return drafts[:kept]

    def take_failures(self) -> dict[str, str]:
        """request id -> message for its client, for each request whose matcher raised in
        bitmasks() since the last call (each failure is reported once: here, or by advance()
        if that comes first). The core ends them with finish_reason "error"."""
        failures, self._failures = self._failures, {}
        return failures

    def advance(self, req: Request, num_new: int = 1) -> GrammarAdvance | None:
        """Feed a request's `num_new` newly sampled tokens (more than one: accepted drafts) to its
        matcher (None: not constrained). An exception from the matcher fails the request:
        GrammarAdvance(False, error=...)."""
        if req.sampling_params.structured_outputs is None:
            return None
        request_id = req.request_id
        if request_id in self._broken:
            self._failures.pop(request_id, None)  # reported here
            return GrammarAdvance(False, error=self._broken[request_id])
        try:
            matcher = self._matchers.get(request_id)
            if matcher is None:  # a sample forked from a constrained request: its own matcher
                grammar = self._grammars[req.parent.request_id]
                self._grammars[request_id] = grammar
                matcher = self._matchers[request_id] = grammar.matcher()
                if req.sampling_params.structured_outputs.reasoning_end is not None:
                    self._reasoning.add(request_id)
            if request_id in self._reasoning:
                return self._follow_reasoning(req, matcher)
            for token in req.output_token_ids[len(req.output_token_ids) - num_new:]:
                if not matcher.accept_token(token):
                    return GrammarAdvance(False)
                if matcher.is_terminated():
                    return GrammarAdvance(True, terminated=True)
            return GrammarAdvance(True, forced=self._forced(req, matcher))
        except Exception as e:
            return GrammarAdvance(False, error=self._break(request_id, e, "following its sampled token"))

    def _follow_reasoning(self, req: Request, matcher: GrammarMatcher) -> GrammarAdvance:
        """A gated request's token inside its reasoning: free; the one that completes the end
        sequence opens the gate (the grammar's start tokens are forced then)."""
        end = req.sampling_params.structured_outputs.reasoning_end
        if tuple(req.output_token_ids[-len(end):]) != end:
            return GrammarAdvance(True)
        self._reasoning.discard(req.request_id)
        return GrammarAdvance(True, forced=self._forced(req, matcher))

    def _break(self, request_id: str, error: Exception, doing: str) -> str:
        """Mark a request whose matcher raised (call from the `except` block); its message."""
        logger.exception("request %s: structured output failed while %s", request_id, doing)
        message = self._broken[request_id] = _failure_message(error)
        return message

    def _forced(self, req: Request, matcher: GrammarMatcher) -> list[int]:
        """Jump-forward: the tokens to append now (see the module docstring for the rule and
        the budgets)."""
        params = req.sampling_params
        if not self.jump_forward or params.logprobs is not None or req.request_id in self._slow:
            return []
        start = time.perf_counter()
        text = matcher.jump_forward()[:MAX_FORCED_CHARS]
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:-1] if text else []
        elapsed = time.perf_counter() - start
        if elapsed > JUMP_FORWARD_SLOW_S:
            self._slow.add(req.request_id)
            logger.warning("request %s: jump-forward took %.1f ms (over %.1f ms): off for the rest of this "
                           "request", req.request_id, elapsed * 1e3, JUMP_FORWARD_SLOW_S * 1e3)
        tokens = tokens[:MAX_FORCED_TOKENS]
        # leave room to sample at least one more token before max_tokens / max_model_len
        room = self.max_model_len - req.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(req.output_token_ids) - 1)
        tokens = tokens[:max(room, 0)]
        tokens = tokens[:matcher.accept_tokens(tokens)]
        self.num_forced_tokens += len(tokens)
        return tokens


def _failure_message(error: Exception) -> str:
    """What the client of a request whose matcher raised is told (the traceback is logged)."""
    return f"structured output failed: {type(error).__name__}"
