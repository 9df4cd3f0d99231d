"""The engine core's side of the boundary: CoreService (apply the client's messages, run a
step), the wire rows, and the core's own process (started by MPCoreClient): the scheduler,
the runner, grammar masks and sampling, off the API server's interpreter.

It loads the model, says ("ready", config, num_kv_blocks), then loops: take every message
the client sent, run a step if anything is unfinished, send one message with the step's
outputs. It exits when told (SHUTDOWN), when its parent process is gone (a killed API
server leaves no core holding the GPU), or after telling ("dead", why) when its loop raised;
SIGINT and SIGTERM it leaves to the API server, which drains first.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
from dataclasses import dataclass, field

from ember.config import EngineConfig
from ember.engine.core import EngineCore, EngineCoreOutput
from ember.engine.stats import EngineStats
from ember.request import Request

logger = logging.getLogger("ember.core")

# the client's messages: (ADD, Request), (ABORT, request_id), (FINISH, request_id, stop string),
# (FAIL, request_id, message), (SHUTDOWN,), (CALL, call_id, operation, args): one of CORE_CALLS
ADD, ABORT, FINISH, FAIL, SHUTDOWN, CALL = range(6)
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
            o.first_token_time)


def stats_row(s: EngineStats) -> tuple:
    return (s.num_running, s.num_waiting, s.num_kv_blocks, s.num_kv_blocks_in_use, s.num_preemptions,
            s.prefix_cache_queries, s.prefix_cache_hits, s.spec_num_drafts, s.spec_num_draft_tokens,
            s.spec_num_accepted_tokens, s.spec_accepted_per_position, s.host_hit_tokens, s.host_bytes_to_host,
            s.host_bytes_to_device)




def run_core_process(config: EngineConfig, input_address: str, output_address: str) -> None:
    import zmq

    # a terminal's Ctrl-C and a supervisor's SIGTERM reach the whole process group (systemd: the
    # whole cgroup); the API server drains its requests, then sends SHUTDOWN. Until then the core
    # keeps serving them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, 0)
    inbox.connect(input_address)
    outbox.connect(output_address)

    def send(message: tuple) -> None:
        outbox.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

    try:
        from ember.engine.input_processor import load_engine_tokenizer

        core = EngineCore(config, load_engine_tokenizer(config))
        core.structured.warm_up()
    except BaseException as e:
        logger.exception("the engine core could not start")
        send(("failed", f"{type(e).__name__}: {e}"))
        context.destroy(linger=1000)
        return
    send(("ready", core.config, core.block_pool.num_blocks))
    code = 0
    try:
        _serve(core, CoreService(core), inbox, send, zmq)
    except _ParentGone:
        logger.warning("the API server process is gone: the engine core stops")
        code = 1
    except BaseException as e:
        logger.exception("the engine core loop died")
        send(("dead", f"{type(e).__name__}: {e}"))
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


def _serve(core, service, inbox, send, zmq) -> None:
    parent = multiprocessing.parent_process().sentinel
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(parent, zmq.POLLIN)
    while True:
        busy = core.has_unfinished_requests()
        events = dict(poller.poll(0 if busy else None))
        if parent in events:
            raise _ParentGone
        messages = []
        while True:
            try:
                messages.append(pickle.loads(inbox.recv(zmq.NOBLOCK, copy=False).buffer))
            except zmq.Again:
                break
        outputs, stop = service.apply(messages)
        if stop:
            return
        if not (messages or busy):
            continue
        step = service.step(outputs)
        send(("step", [output_row(o) for o in step.outputs], stats_row(step.stats), step.num_added, step.results))
