"""The shared-memory broadcast (ember/distributed/shm_broadcast.py) between real processes:
every reader gets every message, whole and in order (small ones, ones spanning many slots,
a writer far ahead of its readers); a reader that dies stops the writer with an error that
names it, and a writer that dies stops its readers; nothing is left in /dev/shm."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from ember.distributed.shm_broadcast import ShmBroadcast

CTX = mp.get_context("spawn")


def _messages(count: int) -> list:
    out = []
    for i in range(count):
        size = [0, 7, 4096, 10_000, 100_000][i % 5]
        out.append({"step": i, "payload": os.urandom(size), "plan": list(range(i % 13))})
    return out


def _digest(obj) -> str:
    return hashlib.sha256(repr(obj).encode()).hexdigest()


def _reader(handle, index: int, count: int, results, slow: bool) -> None:
    bus = ShmBroadcast.attach(handle, index)
    digests = []
    for _ in range(count):
        digests.append(_digest(bus.recv(timeout=60)))
        if slow:
            time.sleep(0.002)
    bus.close()
    results.put((index, digests))


def _shm_names() -> set[str]:
    """The shared-memory segments (the multiprocessing Queue's semaphores aside)."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("psm_")} if Path("/dev/shm").is_dir() \
        else set()


def test_every_reader_gets_every_message_whole_and_in_order():
    before = _shm_names()
    messages = _messages(60)
    bus = ShmBroadcast(readers=3, slots=4, slot_bytes=8192)  # 100 kB messages span 13 slots
    results = CTX.Queue()
    procs = [CTX.Process(target=_reader, args=(bus.handle(), i, len(messages), results, i == 2)) for i in range(3)]
    for p in procs:
        p.start()
    try:
        for m in messages:
            bus.send(m, timeout=60)
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
        bus.close()
    want = [_digest(m) for m in messages]
    assert got == {0: want, 1: want, 2: want}
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert _shm_names() <= before


def _reader_that_dies(handle) -> None:
    bus = ShmBroadcast.attach(handle, 1)
    bus.recv(timeout=60)
    os._exit(3)  # dies holding its place in the ring


def test_a_dead_reader_stops_the_writer_with_an_error_that_names_it():
    bus = ShmBroadcast(readers=2, slots=2, slot_bytes=64)
    dead = CTX.Process(target=_reader_that_dies, args=(bus.handle(),))
    dead.start()
    other = ShmBroadcast.attach(bus.handle(), 0)  # reader 0 keeps up, in this process
    try:
        bus.send("first")
        assert other.recv(timeout=10) == "first"
        dead.join(30)  # it read "first", then died
        for message in ("second", "third"):  # slot 1 is free, slot 0 read by both
            bus.send(message)
            assert other.recv(timeout=10) == message
        with pytest.raises(RuntimeError, match=r"the other side of the broadcast is gone: readers \[1\] did not read"):
            bus.send("fourth", alive=lambda: dead.is_alive())  # slot 1 still holds "second" for reader 1
        with pytest.raises(TimeoutError, match=r"readers \[1\] did not read within 0.2 s"):
            bus.send("fourth", timeout=0.2)
    finally:
        other.close()
        bus.close()


def test_a_reader_whose_writer_is_gone_gets_an_error_not_a_hang():
    bus = ShmBroadcast(readers=1, slots=2, slot_bytes=64)
    reader = ShmBroadcast.attach(bus.handle(), 0)
    try:
        with pytest.raises(RuntimeError, match=r"gone: no message arrived \(reader 0 waits for part 1\)"):
            reader.recv(alive=lambda: False)
        with pytest.raises(TimeoutError, match=r"no message arrived .* within 0.1 s"):
            reader.recv(timeout=0.1)
        bus.send(None)
        assert reader.recv() is None
    finally:
        reader.close()
        bus.close()


def test_bad_shapes_and_roles_are_refused():
    with pytest.raises(ValueError, match="readers >= 1, slots >= 2 and slot_bytes >= 1"):
        ShmBroadcast(readers=0)
    bus = ShmBroadcast(readers=1, slots=2, slot_bytes=16)
    try:
        with pytest.raises(ValueError, match="reader 1 is not one of the 1 readers"):
            ShmBroadcast.attach(bus.handle(), 1)
        with pytest.raises(RuntimeError, match="recv is for readers"):
            bus.recv()
    finally:
        bus.close()
