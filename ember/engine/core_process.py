"""The engine core's side of the boundary: CoreService (apply the client's messages, run a
step), the wire rows, and the core's own process: the scheduler, the runner, grammar masks
and sampling, off the API servers' interpreters. MPCoreClient starts it for its one client;
`ember serve --api-server-count N` (server/api_servers.py) for N API processes, each a client
with its own pair of sockets (ClientTable).

It loads the model, answers each client's HELLO with ("ready", config, num_kv_blocks), then
loops: take every message the clients sent, run a step if anything is unfinished, send each
client one message a step: the outputs of its own requests and the engine's stats. A client
that leaves (SHUTDOWN) or whose process dies loses its requests (aborted: their blocks go
back at once); the others go on. The core exits when every client is gone, when its parent
process is gone (a killed `ember serve` leaves no core holding the GPU), or after telling
("dead", why) when its loop raised; SIGINT and SIGTERM it leaves to the API servers, which
drain first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.core import EngineCore, EngineCoreOutput
from ember.engine.pixel_link import PixelReceiver
from ember.engine.stats import EngineStats
from ember.request import Request

logger = logging.getLogger("ember.core")

# the client's messages: (ADD, Request), (ABORT, request_id), (FINISH, request_id, stop string),
# (FAIL, request_id, message), (SHUTDOWN,): this client leaves (the last one to leave stops the
# core), (CALL, call_id, operation, args): one of CORE_CALLS, (HELLO, pid): a client's first,
# answered ("ready", config, num_kv_blocks)
ADD, ABORT, FINISH, FAIL, SHUTDOWN, CALL, HELLO = range(7)
CORE_CALLS = frozenset({"reset_prefix_cache", "start_profile", "stop_profile", "sleep", "wake_up"})  # EngineCore's


@dataclass(slots=True)
class CoreStep:
    """What the core did since the last CoreStep: outputs of one step (and of requests it
    refused or that failed), its state after it, how many ADDs it has taken in all, and the
    results of the CALLs it took: (call_id, ok, the value or the error's message)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    num_added: int
    results: list[tuple] = field(default_factory=list)


class CoreService:
    """The core's side of the boundary: apply the client's messages, run a step."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.num_added = 0
        self.results: list[tuple] = []  # of CALLs, for the next CoreStep

    def apply(self, messages: list[tuple]) -> tuple[list[EngineCoreOutput], bool]:
        """Apply messages in order; returns the outputs of requests that could not be added
        (each fails alone) and whether SHUTDOWN came."""
        outputs: list[EngineCoreOutput] = []
        for message in messages:
            kind = message[0]
            if kind == ADD:
                self.num_added += 1
                if len(message) > 2:  # its images' pixels could not be put back (ClientTable.take)
                    outputs.append(EngineCoreOutput(message[1].request_id, [], True, finish_reason="error",
                                                    error=message[2]))
                else:
                    outputs += self._add(message[1])
            elif kind == SHUTDOWN:
                return outputs, True
            elif kind == CALL:
                self.results.append(self._call(*message[1:]))
            else:
                try:
                    if kind == ABORT:
                        self.core.abort_request(message[1])
                    elif kind == FINISH:
                        self.core.finish_request(message[1], message[2])
                    elif kind == FAIL:
                        self.core.fail_request(message[1], message[2])
                except Exception:
                    logger.exception("request %s: message %d failed", message[1], kind)
        return outputs, False

    def _add(self, req: Request) -> list[EngineCoreOutput]:
        try:
            self.core.add_request(req)
            return []
        except Exception as e:
            message = str(e) if isinstance(e, ValueError) else \
                f"the request could not be added to the engine ({type(e).__name__})"
            if not isinstance(e, ValueError):
                logger.exception("request %s could not be added", req.request_id)
            self.core.abort_request(req.request_id)
            return [EngineCoreOutput(req.request_id, [], True, finish_reason="error", error=message)]

    def _call(self, call_id: int, operation: str, args: tuple) -> tuple:
        if operation not in CORE_CALLS:
            return call_id, False, f"the engine core has no operation {operation!r}"
        try:
            return call_id, True, getattr(self.core, operation)(*args)
        except ValueError as e:  # what the caller asked for cannot be done now: its message says why
            return call_id, False, str(e)
        except Exception as e:
            logger.exception("the engine core's %s failed", operation)
            return call_id, False, f"{operation} failed in the engine core ({type(e).__name__}; see its log)"

    def step(self, outputs: list[EngineCoreOutput]) -> CoreStep:
        if self.core.has_unfinished_requests():
            outputs = outputs + self.core.step()
        results, self.results = self.results, []
        return CoreStep(outputs, self.core.stats(), self.num_added, results)


def output_row(o: EngineCoreOutput) -> tuple:
    """An output as a plain tuple, EngineCoreOutput's fields in order (pickle's fast path)."""
    return (o.request_id, o.new_token_ids, o.finished, o.logprobs, o.prompt_logprobs, o.pooled, o.parent_id,
            o.index, o.finish_reason, o.stop_reason, o.error, o.num_cached_tokens, o.scheduled_time,
            o.first_token_time, o.cumulative_logprob)


def stats_row(s: EngineStats) -> tuple:
    return (s.num_running, s.num_waiting, s.num_kv_blocks, s.num_kv_blocks_in_use, s.num_preemptions,
            s.prefix_cache_queries, s.prefix_cache_hits, s.spec_num_drafts, s.spec_num_draft_tokens,
            s.spec_num_accepted_tokens, s.spec_accepted_per_position, s.host_hit_tokens, s.host_bytes_to_host,
            s.host_bytes_to_device, s.kv_loads, s.kv_load_seconds, s.sleep_level)




def run_core_process(config: EngineConfig, clients: list[tuple[str, str]], parent: str = "the API server process"
                     ) -> None:
    """The core's process: `clients` are the (input, output) ZMQ addresses of its clients, one
    pair each (the API processes of `ember serve --api-server-count N`, or the one), which it
    binds; `parent` names the process that started it, in the line it logs when that is gone."""
    import zmq

    # a terminal's Ctrl-C and a supervisor's SIGTERM reach the whole process group (systemd: the
    # whole cgroup); the API servers drain their requests, then send SHUTDOWN. Until then the core
    # keeps serving them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    table = ClientTable(context, clients)
    try:
        from ember.engine.input_processor import load_engine_tokenizer

        core = EngineCore(config, load_engine_tokenizer(config))
        # the grammar package's imports and vocabulary tables (~1.3 s) on a thread: ready does not
        # wait for them; a constrained request that comes first waits in the backend's lock
        threading.Thread(target=core.structured.warm_up, name="ember-grammar-warm-up", daemon=True).start()
    except BaseException as e:
        logger.exception("the engine core could not start")
        table.broadcast(("failed", f"{type(e).__name__}: {e}"))
        context.destroy(linger=1000)
        os._exit(1)
    table.ready = ("ready", core.config, core.block_pool.num_blocks)
    code = 0
    try:
        _serve(core, CoreService(core), table, zmq)
    except _ParentGone:
        logger.warning("%s is gone: the engine core stops", parent)
        code = 1
    except BaseException as e:
        logger.exception("the engine core loop died")
        table.broadcast(("dead", f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        try:
            core.finish_in_flight()
        except BaseException:
            pass
        core.shutdown()
        context.destroy(linger=1000)
    if code:
        os._exit(code)


class _ParentGone(Exception):
    pass


SEPARATOR = "|"  # between an API process's index and its request ids, in the core (with several)


class _Client:
    """One client (an API process) as the core sees it: its sockets, its process (from its
    HELLO), the ADDs it sent; with several clients each one's request
    ids are prefixed "i|" in the core, so ids are unique across API processes and every output
    finds its client by its id."""

    def __init__(self, index: int, prefix: str, inbox, outbox) -> None:
        self.index, self.prefix, self.inbox, self.outbox = index, prefix, inbox, outbox
        self.pid: int | None = None
        self.pidfd: int | None = None  # readable once its process has exited
        self.num_added = 0
        self.gone = False  # it left (SHUTDOWN) or its process died
        self.pixels = PixelReceiver()  # the images' pixels it sent once (engine/pixel_link.py)

    @property
    def connected(self) -> bool:
        return self.pid is not None and not self.gone


class ClientTable:
    """The core's clients: what each one sent, made unique across them, and each output sent
    to the client whose request it is. Its poller waits on their sockets and processes."""

    def __init__(self, context, addresses: list[tuple[str, str]]) -> None:
        import zmq

        self._zmq = zmq
        self.ready: tuple | None = None  # the reply to a HELLO, once the core has loaded
        self.clients: list[_Client] = []
        self.poller = zmq.Poller()
        several = len(addresses) > 1
        for i, (input_address, output_address) in enumerate(addresses):
            inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            for sock in (inbox, outbox):
                sock.setsockopt(zmq.LINGER, 0)
            inbox.bind(input_address)
            outbox.bind(output_address)
            self.poller.register(inbox, zmq.POLLIN)
            self.clients.append(_Client(i, f"{i}{SEPARATOR}" if several else "", inbox, outbox))

    def take(self, client: _Client, core: EngineCore) -> list[tuple]:
        """What `client` sent since the last call, as CoreService messages: its request ids
        prefixed, its CALL ids tagged with its index; HELLO and SHUTDOWN handled here."""
        zmq, prefix, messages = self._zmq, client.prefix, []
        while not client.gone:
            try:
                message = pickle.loads(client.inbox.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                break
            kind = message[0]
            if kind == ADD:
                client.num_added += 1
                if prefix:
                    message[1].request_id = prefix + message[1].request_id
                try:
                    client.pixels.fill(message[1])
                except ValueError as e:
                    logger.error("request %s: %s", message[1].request_id, e)
                    message = (ADD, message[1], str(e))
            elif kind in (ABORT, FINISH, FAIL):
                if prefix:
                    message = (kind, prefix + message[1], *message[2:])
            elif kind == CALL:
                message = (CALL, (client.index, message[1]), *message[2:])
            elif kind == HELLO:
                client.pid, client.pidfd = message[1], _pidfd(message[1])
                if client.pidfd is None:
                    self.lose(client, core)
                    break
                self.poller.register(client.pidfd, zmq.POLLIN)
                self.send(client, self.ready)
                continue
            elif kind == SHUTDOWN:
                logger.info("API server %d (process %s) left", client.index, client.pid)
                self.lose(client, core)
                break
            messages.append(message)
        return messages

    def lose_exited(self, events: dict, core: EngineCore) -> bool:
        """Lose the clients whose process exited (polled `events`); whether there were any."""
        exited = [c for c in self.clients if c.pidfd is not None and c.pidfd in events]
        for c in exited:
            logger.warning("API server %d (process %s) exited: its requests are aborted", c.index, c.pid)
            self.lose(c, core)
        return bool(exited)

    def lose(self, client: _Client, core: EngineCore) -> None:
        """`client` is gone: abort every request it sent (their blocks go back to the pool)."""
        client.gone = True
        self.poller.unregister(client.inbox)
        if client.pidfd is not None:
            self.poller.unregister(client.pidfd)
            os.close(client.pidfd)
            client.pidfd = None
        for request_id in core.request_ids():
            if request_id.startswith(client.prefix):
                core.abort_request(request_id)

    def all_gone(self) -> bool:
        """Every client has left or died (one that never said HELLO has not)."""
        return all(c.gone for c in self.clients)

    def send_step(self, step: CoreStep) -> None:
        """The step's outputs to the clients whose requests they are; the stats to every client."""
        rows: list[list[tuple]] = [[] for _ in self.clients]
        if len(self.clients) == 1:
            rows[0] = [output_row(o) for o in step.outputs]
        else:
            for o in step.outputs:
                index, _, o.request_id = o.request_id.partition(SEPARATOR)
                if o.parent_id is not None:
                    o.parent_id = o.parent_id.partition(SEPARATOR)[2]
                rows[int(index)].append(output_row(o))
        results: list[list[tuple]] = [[] for _ in self.clients]
        for (index, call_id), ok, value in step.results:
            results[index].append((call_id, ok, value))
        stats = stats_row(step.stats)
        for c in self.clients:
            if c.connected:
                self.send(c, ("step", rows[c.index], stats, c.num_added, results[c.index]))

    def broadcast(self, message: tuple) -> None:
        """`message` to every client, as far as it goes within a second each (the core is ending)."""
        for c in self.clients:
            if not c.gone:
                self.send(c, message, timeout_ms=1000)

    def send(self, client: _Client, message: tuple, timeout_ms: int | None = None) -> None:
        """Send, but never hang on a client that died: while its queue is full, wait until it
        has room or its process is gone (or `timeout_ms` passed): then the message is dropped."""
        zmq = self._zmq
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        poller = None
        while True:
            try:
                client.outbox.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if poller is None:
                    poller = zmq.Poller()
                    poller.register(client.outbox, zmq.POLLOUT)
                    if client.pidfd is not None:
                        poller.register(client.pidfd, zmq.POLLIN)
                events = dict(poller.poll(timeout_ms if timeout_ms is not None else 1000))
                if (client.pidfd is not None and client.pidfd in events) or (timeout_ms is not None and not events):
                    return


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when process `pid` exits (None if it is gone already)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _serve(core: EngineCore, service: CoreService, table: ClientTable, zmq) -> None:
    parent = multiprocessing.parent_process().sentinel
    table.poller.register(parent, zmq.POLLIN)
    while True:
        busy = core.has_unfinished_requests()
        events = dict(table.poller.poll(0 if busy else None))
        if parent in events:
            raise _ParentGone
        lost = table.lose_exited(events, core)
        messages = []
        for c in table.clients:
            if not c.gone:
                messages += table.take(c, core)
        if table.all_gone():
            return
        outputs, _ = service.apply(messages)
        if messages or busy or lost:
            table.send_step(service.step(outputs))
