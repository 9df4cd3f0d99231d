"""The engine core's own process (started by MPCoreClient): the scheduler, the runner,
grammar masks and sampling, off the API server's interpreter.

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

from ember.config import EngineConfig

logger = logging.getLogger("ember.core")


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
        from ember.engine.core import EngineCore
        from ember.engine.core_client import CoreService
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
    from ember.engine.core_client import output_row, stats_row

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
        send(("step", [output_row(o) for o in step.outputs], stats_row(step.stats), step.num_added))
