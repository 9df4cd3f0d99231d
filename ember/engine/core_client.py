"""The engine client: the one way into the engine core for AsyncEngine (and so the server).

    API process                                     core process (MPCoreClient)
    ───────────                                     ────────────
    send(ADD, request) / (ABORT, id) /   ── ZMQ PUSH ──>  CoreService.apply(messages)
         (FINISH, id, stop) / (FAIL, id, msg)              EngineCore.step()
    get_step() -> CoreStep               <── ZMQ PULL ──  one message a step: each request's
                                                           new tokens (deltas) + EngineStats

Both directions carry plain data only: a `Request` as made by the input processor (before
the core touches it), and `EngineCoreOutput`s (new token ids, logprobs, finish reason).
`InprocCoreClient` runs the same `CoreService` on the caller's thread (one process: tests
patch the core's objects there, and `--no-core-process` serves that way). With `ember serve
--api-server-count N` one core process serves N API processes, each an MPCoreClient over a
CoreConnection: its own pair of sockets; in the core its request ids carry its index (unique
across them) and each step's outputs go to the client whose requests they are
(core_process.ClientTable).

The transport is ZeroMQ over Unix sockets (its I/O thread queues what the other side has not
read yet, so neither side blocks on the other) with pickle of plain tuples: a 256-request
step costs ~45 us to encode and ~100 us to decode into outputs (BENCHMARKS.md), against
tens of ms a GPU step takes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass

from ember.config import EngineConfig
from ember.engine.core import EngineCore, EngineCoreOutput
from ember.engine.core_process import (
    ABORT,
    ADD,
    CALL,
    FAIL,
    FINISH,
    HELLO,
    SHUTDOWN,
    CoreService,
    CoreStep,
    output_row,
    run_core_process,
    stats_row,
)
from ember.engine.output_processor import ProcessedOutputs
from ember.engine.pixel_link import PixelSender
from ember.engine.stats import EngineStats
from ember.loader.tokenizer import Tokenizer
from ember.request import Request
from ember.scheduler.scheduler import check_request_fits
from ember.scheduler.sliding_window import make_window_blocks, shared_window
from ember.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# the message kinds and wire rows are the core process's (core_process.py); its clients speak them
__all__ = ["ABORT", "ADD", "CALL", "FAIL", "FINISH", "SHUTDOWN", "CoreConnection", "CoreDeadError", "CoreStep",
           "InprocCoreClient", "MPCoreClient", "RequestChecker", "StartedCore", "output_row", "send_text_verdicts",
           "start_core_process", "stats_row"]

START_TIMEOUT_S = 600.0  # loading a model (and compiling kernels) before the core reports ready
POLL_MS = 100  # how long get_step waits for the core before it gives the caller a turn


class CoreDeadError(RuntimeError):
    """The engine core stopped working (its loop raised, or its process died)."""


class InprocCoreClient:
    """The core on the thread that calls get_step; send() from any thread queues a message."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        self.core = EngineCore(config, tokenizer)
        self.config = self.core.config
        self.num_kv_blocks = self.core.block_pool.num_blocks
        self.pid = os.getpid()  # the process the core runs in
        self._service = CoreService(self.core)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._messages: list[tuple] = []
        self._woken = False

    def check_request(self, req: Request) -> None:
        self.core.check_request(req)

    def warm_up(self) -> None:
        self.core.structured.warm_up()

    def send(self, message: tuple) -> None:
        with self._lock:
            self._messages.append(message)
            self._wakeup.notify()

    def wake(self) -> None:
        """Make a waiting get_step return."""
        with self._lock:
            self._woken = True
            self._wakeup.notify()

    def get_step(self) -> CoreStep | None:
        """Apply what was sent and run a step (waits while there is nothing to do)."""
        with self._lock:
            while not (self._messages or self._woken or self.core.has_unfinished_requests()):
                self._wakeup.wait()
            messages, self._messages, self._woken = self._messages, [], False
        outputs, _ = self._service.apply(messages)
        return self._service.step(outputs)

    def settle(self) -> None:
        """Apply what is queued (aborts) and collect a step still in flight, outputs dropped."""
        with self._lock:
            messages, self._messages = self._messages, []
        self._service.apply(messages)
        self.core.finish_in_flight()

    def shutdown(self) -> None:
        """settle(), then stop the TP workers."""
        self.settle()
        self.core.shutdown()


class RequestChecker:
    """What the core would refuse at once, checked in the API process (the input pool's
    threads): sizes and a grammar that cannot compile."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, structured: StructuredOutputManager) -> None:
        self.config, self.num_kv_blocks = config, num_kv_blocks
        self.window = make_window_blocks(config.block_size, shared_window(config.model_config.layer_windows))
        self.structured = structured

    def __call__(self, req: Request) -> None:
        check_request_fits(req, self.config.max_num_seqs, self.config.max_model_len, self.window,
                           self.num_kv_blocks)
        self.structured.validate(req.sampling_params)


@dataclass(frozen=True)
class StartedCore:
    """An engine core process for one client, started before the client: `ember serve` starts
    it before importing its web stack, so the model loads meanwhile (MPCoreClient adopts it)."""

    process: multiprocessing.process.BaseProcess
    addresses: tuple[str, str]  # (input, output): the ZMQ sockets the core binds
    directory: str  # where the sockets are

    def stop(self) -> None:
        """Kill the core if no client stopped it (the server failed before it adopted it)."""
        _stop_process(self.process, None, self.directory)


def start_core_process(config: EngineConfig) -> StartedCore:
    """Spawn the engine core process of `config` (resolved) for one client."""
    directory = tempfile.mkdtemp(prefix="ember-core-")
    addresses = (f"ipc://{directory}/input", f"ipc://{directory}/output")
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds torch's threads
    process = spawn.Process(target=run_core_process, args=(config, [addresses]),
                            name="ember-core", daemon=False)  # it starts TP workers of its own
    process.start()
    return StartedCore(process, addresses, directory)


@dataclass(frozen=True)
class CoreConnection:
    """An engine core process that another process started (`ember serve --api-server-count N`'s
    launcher, server/api_servers.py), and the pair of its sockets that is this client's."""

    input_address: str
    output_address: str
    pid: int  # the core's process
    index: int  # which of its clients this one is


class MPCoreClient:
    """The core in its own process (ember/engine/core_process.py), over two ZMQ sockets: one
    for this client alone (it starts it, or adopts a StartedCore), or, given a CoreConnection,
    one it shares with other clients (each its own requests; see ClientTable)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None,
                 connection: CoreConnection | StartedCore | None = None) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)  # to the core
        self._output = self._context.socket(zmq.PULL)  # from the core
        for sock in (self._input, self._output):
            sock.setsockopt(zmq.LINGER, 0)
        self._send_lock = threading.Lock()
        self._pixels = PixelSender()
        self.process: multiprocessing.process.BaseProcess | None = None
        if not isinstance(connection, CoreConnection):
            started = connection or start_core_process(config)
            self.process = started.process
            addresses = started.addresses
            self.pid = self.process.pid  # the process the core runs in
            self._core_fd = self.process.sentinel
            self._finalizer = weakref.finalize(self, _stop_process, self.process, self._context, started.directory)
        else:
            addresses = (connection.input_address, connection.output_address)
            self.pid = connection.pid
            try:
                self._core_fd = os.pidfd_open(connection.pid)
            except ProcessLookupError:
                self._context.destroy(linger=0)
                raise CoreDeadError(f"the engine core process {connection.pid} is gone") from None
            self._finalizer = weakref.finalize(self, _close, self._context, self._core_fd)
        self._input.connect(addresses[0])
        self._output.connect(addresses[1])
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self._core_fd, zmq.POLLIN)
        # this process's grammar backend (imports, vocabulary tables: ~1.5 s) is built while the core
        # loads the model, not after it; the core changes no field it reads (only max_num_seqs)
        structured = StructuredOutputManager.for_config(config, tokenizer)
        self._warming = threading.Thread(target=structured.warm_up, name="ember-grammar-warm-up", daemon=True)
        self._warming.start()
        try:
            self.send((HELLO, os.getpid()))
            ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.config, self.num_kv_blocks = ready
        self._checker = RequestChecker(self.config, self.num_kv_blocks, structured)

    def _wait_ready(self) -> tuple[EngineConfig, int]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            message = self._receive(1000)
            if message is None:
                continue
            kind, *rest = message
            if kind == "ready":
                return rest[0], rest[1]
            raise RuntimeError(f"the engine core could not start: {rest[0]}")
        raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:g} s")

    def _receive(self, timeout_ms: int):
        """The core's next message (unpickled), None after timeout_ms; CoreDeadError if its
        process is gone and nothing is left to read."""
        events = dict(self._poller.poll(timeout_ms))
        if self._output in events:
            return pickle.loads(self._output.recv(copy=False).buffer)
        if self._core_fd in events:
            if self.process is None:
                raise CoreDeadError(f"the engine core process {self.pid} exited")
            self.process.join(1)
            raise CoreDeadError(f"the engine core process exited (exit code {self.process.exitcode})")
        return None

    def check_request(self, req: Request) -> None:
        self._checker(req)

    def warm_up(self) -> None:
        self._warming.join()  # this process's backend, built while the core loaded (the core warmed its own)

    def send(self, message: tuple) -> None:
        if message[0] == ADD and message[1].mm_features:  # its images' pixels once each (pixel_link.py)
            with self._send_lock:  # stripped in the order sent: the core's receiver follows it
                message = (ADD, self._pixels.strip(message[1]))
                self._input.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
            return
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:  # a ZMQ socket is not thread-safe
            self._input.send(data, copy=False)

    def wake(self) -> None:
        pass  # get_step returns every POLL_MS anyway

    def settle(self) -> None:
        pass  # the core applies the aborts and collects its steps on its own

    def get_step(self) -> CoreStep | None:
        message = self._receive(POLL_MS)
        if message is None:
            return None
        if message[0] == "dead":
            raise CoreDeadError(f"the engine core failed: {message[1]}")
        _, rows, stats, num_added, results = message
        return CoreStep([EngineCoreOutput(*row) for row in rows], EngineStats(*stats), num_added, results)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the core this client leaves: a core of its own stops (it aborts what is left
        and stops its TP workers; waited for up to `timeout` s), a shared one aborts this
        client's requests and serves the others. Then clean up (once: a second call does nothing)."""
        if not self._finalizer.alive:
            return
        if self.process is None:
            if not select.select([self._core_fd], [], [], 0)[0]:  # its pidfd turns readable once it exited
                try:
                    self.send((SHUTDOWN,))
                    self._input.close(linger=int(timeout * 1000))  # delivered before the context ends
                except Exception:
                    pass
        elif self.process.is_alive():
            try:
                self.send((SHUTDOWN,))
            except Exception:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine core did not stop within %g s: killing it", timeout)
        self._finalizer()


def _stop_process(process, context, directory: str) -> None:
    """Kill the core if it still runs (a client never shut down: this process is exiting),
    and remove the sockets."""
    if process.is_alive():
        process.kill()
        process.join(5)
    if context is not None:
        context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)


def _close(context, core_fd: int) -> None:
    context.destroy(linger=0)
    os.close(core_fd)


def send_text_verdicts(client: InprocCoreClient | MPCoreClient, done: ProcessedOutputs) -> None:
    """Tell the core what the output processor decided on the text: the requests a stop string
    ended (FINISH) and those whose text failed (FAIL)."""
    for request_id, stop in done.stopped:
        client.send((FINISH, request_id, stop))
    for request_id, message in done.failed:
        client.send((FAIL, request_id, message))
