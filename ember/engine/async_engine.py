"""AsyncEngine: the engine client behind an asyncio front, its outputs processed on a thread.

    event loop thread                          output thread
    ─────────────────                          ─────────────
    await prepare(fn): tokenize, template,
      validate, on the input pool (threads)
    submit(req) / add_request()        ──┐
      (InputProcessor; errors raise here)│ client.send(ADD / ABORT) ──> the engine core
    abort(request_id)                  ──┘   (its own process, or run by client.get_step)
                                               client.get_step(): one step's new tokens
                                               OutputProcessor: text, stop strings
    RequestStream (deque + Event) <── call_soon_threadsafe(put) ── one output per request
                                                                   that changed

With `core_process=True` (what `ember serve` runs) the core is in its own process
(core_client.MPCoreClient, core_process.py): scheduling, the model's launches and sampling
never wait for this interpreter. With `core_connection` that process is one another process
started: shared with the others (a CoreConnection: each API process of `ember serve
--api-server-count N`), or this engine's own, started early (a StartedCore: `ember serve`).
Otherwise (InprocCoreClient) the output thread runs the core's steps itself, as one process.

The event loop never runs per-request work that grows with the input: `prepare` runs it
on a small thread pool (INPUT_THREADS), so a 1 MB prompt or a deep JSON schema does not
stall other clients or /health.

Isolation: adding, aborting and processing one request on the engine thread fails that
request alone (its stream raises RequestFailedError, or ValueError for input the core
refused); EngineCore does the same for a request's own work inside a step. Anything else
that raises kills the loop: every stream fails with EngineDeadError, new requests are
refused, and `on_dead` tells the owner (the server exits non-zero so a supervisor restarts it).

The output thread owns the OutputProcessor (and, in one process, the core): nothing else
touches them. With every step comes the core's `EngineStats` snapshot (one attribute
assignment, so any thread may read it), and after every step the thread hands
`IterationStats` to its stat loggers (Prometheus, the log line): one set of numbers, kept
in this process, whichever process the core runs in.

A RequestStream yields cumulative RequestOutputs; when the consumer falls behind, the
outputs waiting in its queue collapse into the newest (each one holds all text so far).
Closing a stream before its request finished (a client that went away) aborts the
request: its KV blocks are freed on the engine thread's next pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from ember.config import EngineConfig
from ember.engine.core import EngineCoreOutput
from ember.engine.core_client import (
    ABORT,
    ADD,
    CALL,
    CoreConnection,
    CoreStep,
    InprocCoreClient,
    MPCoreClient,
    StartedCore,
    send_text_verdicts,
)
from ember.engine.input_processor import InputProcessor, PromptType, load_engine_tokenizer
from ember.engine.output_processor import OutputProcessor
from ember.engine.stats import EngineStats, FinishedRequestStats, IterationStats, StatLogger
from ember.outputs import RequestOutput
from ember.request import Request
from ember.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """More requests wait than `max_waiting_requests` allows: try again later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its loop died: it takes no new request."""


class EngineDeadError(EngineStoppedError):
    """The engine loop died: every request in flight fails, and no new one is taken."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (finish_reason "error"); the others go on. The
    message is safe to show its client: the traceback is in the log."""


# threads that tokenize, render templates, check grammars and process images for the event loop:
# one a CPU up to 8 (image processing, PIL and numpy, runs mostly without the GIL), at least 2
INPUT_THREADS = min(8, max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2))
T = TypeVar("T")


def _put_all(batch: list) -> None:  # runs on the event loop
    for stream, item in batch:
        stream._put(item)


_END = object()  # ends a stream whose request was aborted or that the engine gave up on


class RequestStream:
    """The outputs of one request, as an async iterator. `abort()` (or leaving an
    `async with` block, or being garbage-collected) before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self._engine = engine
        self._loop = loop
        self._items: deque = deque()  # RequestOutput, then maybe _END or an exception
        self._ready = asyncio.Event()
        self._done = False  # the consumer saw the end, or gave up

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            try:
                await self._ready.wait()
            except BaseException:  # cancelled: the consumer is gone
                self.abort()
                raise
        item = self._items.popleft()
        while isinstance(item, RequestOutput) and self._items and isinstance(self._items[0], RequestOutput):
            item = self._items.popleft()  # a backlog collapses into the newest output
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def __del__(self) -> None:  # a safety net: a stream nobody reads any more frees its request
        if not getattr(self, "_done", True):
            try:
                self._engine.abort(self.request_id)
            except Exception:
                pass

    def _put(self, item) -> None:  # runs on the event loop (call_soon_threadsafe)
        self._items.append(item)
        self._ready.set()


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 stat_loggers: list[StatLogger] | None = None,
                 on_dead: Callable[[BaseException], None] | None = None, log_requests: bool = False,
                 core_process: bool = False, core_connection: CoreConnection | StartedCore | None = None) -> None:
        """`on_dead(error)` is called on the output thread if the engine dies; `log_requests`:
        log each submitted request's id, prompt length and sampling parameters at INFO;
        `core_process`: run the engine core in its own process; `core_connection`: the core process
        to use instead of starting one: shared with other clients (CoreConnection), or this
        engine's own, started early (StartedCore)."""
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1 (or None: no limit); got {max_waiting_requests}")
        self.config = config.resolve()
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        self.tokenizer = load_engine_tokenizer(self.config)
        if core_connection is not None:
            self.client = MPCoreClient(self.config, self.tokenizer, core_connection)
        else:
            self.client = (MPCoreClient if core_process else InprocCoreClient)(self.config, self.tokenizer)
        self.config = self.client.config  # the seats the KV pool allows, where max_num_seqs was the default
        self.inputs = InputProcessor(self.config, self.tokenizer, self.client.check_request)
        self._processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.stat_loggers = list(stat_loggers or [])
        # the output thread's own: each request as added, when each sample's last token came,
        # and how many tokens each request got
        self._requests: dict[str, Request] = {}
        self._token_times: dict[str, dict[int, float]] = {}
        self._generated: dict[str, int] = {}
        # shared between the threads, under _lock
        self._lock = threading.Lock()
        self._new: list[Request] = []  # sent to the core, not yet known to the output processor
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._num_sent = 0  # ADDs sent; the core's CoreStep.num_added says how many it took
        self._calls: dict[int, cf.Future] = {}  # CALLs sent, by id, until the core answers
        self._num_taken = 0
        self._accepting = True
        self._stop = False
        self._stop_error: BaseException | None = None  # what streams left at stop() get
        self.error: BaseException | None = None  # what killed the engine, if anything
        self.on_dead = on_dead
        self._input_pool = cf.ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="ember-input")
        self._ended: list[FinishedRequestStats] = []  # aborted, for the stats
        self.stats = EngineStats(num_kv_blocks=self.client.num_kv_blocks)
        self._recorded_stats = self.stats
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self._thread.start()

    @property
    def core(self):
        """The EngineCore, when it runs in this process (tests reach into it there)."""
        return self.client.core

    @property
    def core_pid(self) -> int:
        """The process the engine core runs in (this one, without core_process)."""
        return self.client.pid

    @property
    def sleeping(self) -> int:
        """The engine core's sleep level (0: awake) as of its last step: a sleep that another
        API process asked for shows here too."""
        return self.stats.sleep_level

    @property
    def num_kv_blocks(self) -> int:
        return self.client.num_kv_blocks

    def warm_up(self) -> None:
        """Prepare the grammar backend now, not on the first constrained request."""
        self.client.warm_up()

    # -- the asyncio side -----------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stop

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the input pool: input work that grows with the request
        (tokenizing, chat templates, grammar checks) stays off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def call(self, operation: str, *args: Any, timeout: float = 600.0) -> Any:
        """Run one of the engine core's operations (core_process.CORE_CALLS) between its steps;
        its result, or ValueError with the core's reason."""
        with self._lock:
            if self.error is not None or self._stop:
                raise EngineStoppedError("the engine is shutting down")
            call_id = next(self._ids)
            future: cf.Future = cf.Future()
            self._calls[call_id] = future
            self.client.send((CALL, call_id, operation, args))
        self.client.wake()
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Validate and queue one request (on this thread: `prepare` + `submit` keeps the
        event loop free); iterate the returned stream for its outputs. Raises ValueError for
        bad input, EngineOverloadedError when too many wait, and EngineStoppedError once
        shutting down. Call it from the event loop's thread."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        params = params or SamplingParams(**self.config.sampling_defaults)  # the model's defaults, as LLM's
        return self.submit(self.inputs.make_request(request_id, prompt, params, priority))

    def submit(self, req: Request) -> RequestStream:
        """Queue a request made by `self.inputs.make_request`; call it from the event loop's thread."""
        loop = asyncio.get_running_loop()
        request_id = req.request_id
        with self._lock:
            if not self._accepting or self.error is not None:
                raise (EngineStoppedError("the engine is shutting down") if self.error is None
                       else EngineDeadError(f"the engine loop died: {self.error!r}"))
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            waiting = self.stats.num_waiting + self._num_sent - self._num_taken
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(f"{waiting} requests are waiting already "
                                            f"(max_waiting_requests={self.max_waiting_requests}): retry later")
            stream = RequestStream(self, req, loop)
            self._streams[request_id] = stream
            self._new.append(req)
            self._num_sent += 1
            self.client.send((ADD, req))  # under the lock: the core sees ADDs in _new's order
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", request_id, req.num_prompt_tokens, req.sampling_params)
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None):
        """add_request + iterate, as one async generator; closing it aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        async with stream:
            async for out in stream:
                yield out

    def current_stats(self) -> EngineStats:
        """The last snapshot, with requests the core has not taken yet counted as waiting."""
        with self._lock:
            stats, pending = self.stats, self._num_sent - self._num_taken
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + pending) if pending else stats

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; the core frees its blocks on its next pass."""
        with self._lock:
            self._aborts.append(request_id)
            if not self._stop:
                self.client.send((ABORT, request_id))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` s, then fail
        what is left (EngineStoppedError: its client is told the server is shutting down)
        and stop the engine."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._in_flight() and self._thread.is_alive():
            await asyncio.sleep(0.05)
        left = EngineStoppedError(f"the server is shutting down: the request did not finish within "
                                  f"the shutdown timeout ({timeout:g} s)")
        await asyncio.to_thread(self.stop, left)

    def stop(self, error: BaseException | None = None) -> None:
        """Abort everything, join the output thread and stop the core (blocking). Streams
        still open end (or, given `error`, raise it)."""
        with self._lock:
            self._accepting = False
            self._stop = True
            self._stop_error = error
        self.client.wake()
        self._thread.join()
        self._input_pool.shutdown(wait=False, cancel_futures=True)
        self.client.shutdown()

    def _in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    # -- the output thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                step = self.client.get_step()
                self._take_new_and_aborts()
                if step is not None:
                    self._on_step(step)
        except BaseException as e:  # the engine died: fail every stream, refuse new requests
            logger.exception("the engine loop died")
            self.error = e
            if self.on_dead is not None:  # the owner first: a client that sees its stream fail finds it told
                self.on_dead(e)
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            return
        self._take_new_and_aborts()
        self._fail_all(self._stop_error)  # stopped: end (or fail) whatever is left

    def _take_new_and_aborts(self) -> None:
        """Track the requests sent since the last pass; end the streams of those aborted."""
        with self._lock:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self._processor.add_request(req)
            self._requests[req.request_id] = req
        for request_id in aborts:
            self._processor.abort(request_id)
            req = self._requests.pop(request_id, None)
            if req is not None:
                self._ended.append(_finished_stats(req, "abort", self._generated.pop(request_id, 0)))
            self._token_times.pop(request_id, None)
            self._end_stream(request_id, _END)
            logger.debug("aborted %s", request_id)
        if self._ended:
            self._record(IterationStats(finished=self._ended))
            self._ended = []

    def _on_step(self, step: CoreStep) -> None:
        # the counters as last recorded: a step without outputs (a chunk of a long prompt) records
        # nothing, and its counts (the prefix-cache lookups of its admissions) go with the next step's
        before = self._recorded_stats
        with self._lock:
            self.stats, self._num_taken = step.stats, step.num_added  # before the outputs: fresh numbers
            answered = [(self._calls.pop(call_id), ok, value) for call_id, ok, value in step.results]
        for future, ok, value in answered:
            if not future.done():  # (its caller may have given up waiting)
                future.set_result(value) if ok else future.set_exception(ValueError(value))
        if not step.outputs:
            return
        now = time.monotonic()
        done = self._processor.process(step.outputs)
        send_text_verdicts(self.client, done)
        outputs = done.outputs
        iteration = self._iteration_stats(step.outputs, outputs, now)
        iteration.num_preemptions = step.stats.num_preemptions - before.num_preemptions
        iteration.prefix_cache_queries = step.stats.prefix_cache_queries - before.prefix_cache_queries
        iteration.prefix_cache_hits = step.stats.prefix_cache_hits - before.prefix_cache_hits
        after = step.stats
        iteration.host_hit_tokens = after.host_hit_tokens - before.host_hit_tokens
        iteration.host_bytes_to_host = after.host_bytes_to_host - before.host_bytes_to_host
        iteration.host_bytes_to_device = after.host_bytes_to_device - before.host_bytes_to_device
        if after.spec_num_drafts != before.spec_num_drafts:  # speculative decoding
            iteration.spec_num_drafts = after.spec_num_drafts - before.spec_num_drafts
            iteration.spec_num_draft_tokens = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            iteration.spec_num_accepted_tokens = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            earlier = before.spec_accepted_per_position
            iteration.spec_accepted_per_position = [n - (earlier[i] if i < len(earlier) else 0)
                                                    for i, n in enumerate(after.spec_accepted_per_position)]
        self._record(iteration)
        self._recorded_stats = after
        deliveries = []
        with self._lock:
            for out in outputs:
                stream = self._streams.pop(out.request_id, None) if out.finished else \
                    self._streams.get(out.request_id)
                if stream is not None:
                    deliveries.append((stream, out))
        self._send_all(deliveries)

    def _record(self, iteration: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.stats, iteration)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)

    def _iteration_stats(self, core_outputs: list[EngineCoreOutput], outputs: list[RequestOutput],
                         now: float) -> IterationStats:
        it = IterationStats()
        for o in core_outputs:
            if not o.new_token_ids:
                continue
            root = o.parent_id if o.parent_id is not None else o.request_id
            req = self._requests.get(root)
            if req is None:
                continue
            it.num_generation_tokens += len(o.new_token_ids)
            self._generated[root] = self._generated.get(root, 0) + len(o.new_token_ids)
            times = self._token_times.setdefault(root, {})
            last = times.get(o.index)
            if last is not None:
                it.inter_token_latencies.append(now - last)
            elif not times:  # the request's first token (its forks share the prompt)
                it.num_prompt_tokens += req.num_prompt_tokens
                it.time_to_first_tokens.append(now - req.arrival_time)
            times[o.index] = now
        ends = {o.parent_id if o.parent_id is not None else o.request_id: o for o in core_outputs if o.finished}
        for out in outputs:
            if not out.finished:
                continue
            self._token_times.pop(out.request_id, None)
            self._generated.pop(out.request_id, None)
            req = self._requests.pop(out.request_id, None)
            if req is None:
                continue
            reason = "error" if out.error is not None else out.outputs[0].finish_reason or "abort"
            end = ends.get(out.request_id)
            it.finished.append(_finished_stats(req, reason, sum(len(c.token_ids) for c in out.outputs), now,
                                               end.scheduled_time if end else None,
                                               end.first_token_time if end else None))
        return it

    def _end_stream(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._send(stream, item)

    def _fail_all(self, error: BaseException | None) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if not future.done():
                future.set_exception(error if error is not None else EngineStoppedError("the engine stopped"))
        for stream in streams:
            self._processor.abort(stream.request_id)
            if self.error is None:
                try:
                    self.client.send((ABORT, stream.request_id))
                except Exception:
                    pass
            self._send(stream, error if error is not None else _END)

    @staticmethod
    def _send_all(deliveries: list[tuple[RequestStream, RequestOutput]]) -> None:
        """A step's outputs wake each event loop once, not once per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # its event loop is closed: nobody is listening
                pass

    @staticmethod
    def _send(stream: RequestStream, item) -> None:
        AsyncEngine._send_all([(stream, item)])


def _finished_stats(req: Request, reason: str, num_generation_tokens: int, now: float | None = None,
                    scheduled_time: float | None = None, first_token_time: float | None = None
                    ) -> FinishedRequestStats:
    """A request's numbers at its end (the core's times where its final output gave them)."""
    now = time.monotonic() if now is None else now
    scheduled = scheduled_time or now
    first_token = first_token_time or now
    return FinishedRequestStats(
        finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens, num_generation_tokens=num_generation_tokens,
        e2e_latency=now - req.arrival_time, queue_time=scheduled - req.arrival_time,
        prefill_time=first_token - scheduled, decode_time=now - first_token)
