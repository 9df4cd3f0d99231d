"""One writer, N readers (its child processes), on one host: each message is written once into shared memory and
read by every reader (the step plan a scheduler sends to its tensor-parallel workers), instead
of one pipe or RPC per reader per step.

Layout: a ring of `slots` slots of `slot_bytes` payload each. A slot's header holds the
sequence number of the message part in it (0: never written), the part's length, how many
parts of the message follow it, and one "read" byte per reader. The writer of part k takes
slot k % slots once every reader has read what it held, writes the payload and the length,
clears the read bytes, and publishes the sequence number last; reader r waits for sequence
k + 1 in that slot, copies the payload, and sets its read byte. A message larger than a slot
spans consecutive slots. Ordering relies on CPython executing the stores in program order
on x86's total store order (this is what the engine targets; an ARM host would need fences).

Waits poll with a growing sleep (up to 1 ms) and end with TimeoutError after `timeout`, or
with RuntimeError as soon as `alive()` (the other side's liveness) says False.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

_HEADER = struct.Struct("<QQQ")  # sequence number, part length, parts after this one
_MAX_SLEEP_S = 1e-3


class ShmBroadcast:
    """Create it in the writer with `readers`; hand `handle()` to each reader, which opens
    it with `ShmBroadcast.attach(handle, reader_index)`."""

    def __init__(self, readers: int, slots: int = 8, slot_bytes: int = 1 << 20, *, _name: str | None = None,
                 _reader: int | None = None) -> None:
        if readers < 1 or slots < 2 or slot_bytes < 1:
            raise ValueError(f"ShmBroadcast needs readers >= 1, slots >= 2 and slot_bytes >= 1; got {readers}, "
                             f"{slots}, {slot_bytes}")
        self.readers, self.slots, self.slot_bytes = readers, slots, slot_bytes
        self.stride = _HEADER.size + readers + slot_bytes
        self.reader = _reader
        if _name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=slots * self.stride)
            self.shm.buf[:slots * self.stride] = bytes(slots * self.stride)
        else:
            # readers are the writer's child processes, which share its resource tracker: the
            # segment stays registered once, and the writer's close() unlinks it
            self.shm = shared_memory.SharedMemory(name=_name)
        self.buf = self.shm.buf
        self.next_part = 0  # the writer's next part, or this reader's

    def handle(self) -> tuple[str, int, int, int]:
        return self.shm.name, self.readers, self.slots, self.slot_bytes

    @classmethod
    def attach(cls, handle: tuple[str, int, int, int], reader: int) -> ShmBroadcast:
        name, readers, slots, slot_bytes = handle
        if not 0 <= reader < readers:
            raise ValueError(f"reader {reader} is not one of the {readers} readers")
        return cls(readers, slots, slot_bytes, _name=name, _reader=reader)

    # -- the writer --------------------------------------------------------------------------

    def send(self, obj: Any, timeout: float = 60.0, alive: Callable[[], bool] = lambda: True) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        parts = [data[i:i + self.slot_bytes] for i in range(0, len(data), self.slot_bytes)] or [b""]
        for i, part in enumerate(parts):
            base = (self.next_part % self.slots) * self.stride
            flags = slice(base + _HEADER.size, base + _HEADER.size + self.readers)
            seq = _HEADER.unpack_from(self.buf, base)[0]
            if seq:  # the slot holds an earlier part: wait until every reader has it
                _wait(lambda: all(self.buf[flags]), timeout, alive,
                      lambda: f"readers {[r for r in range(self.readers) if not self.buf[flags][r]]} did not read")
            start = flags.stop
            self.buf[start:start + len(part)] = part
            self.buf[flags] = bytes(self.readers)
            _HEADER.pack_into(self.buf, base, 0, len(part), len(parts) - 1 - i)
            self.next_part += 1
            struct.pack_into("<Q", self.buf, base, self.next_part)  # published last

    # -- a reader ----------------------------------------------------------------------------

    def recv(self, timeout: float = 60.0, alive: Callable[[], bool] = lambda: True) -> Any:
        if self.reader is None:
            raise RuntimeError("recv is for readers: open the broadcast with ShmBroadcast.attach")
        chunks = []
        while True:
            base = (self.next_part % self.slots) * self.stride
            want = self.next_part + 1
            _wait(lambda: struct.unpack_from("<Q", self.buf, base)[0] == want, timeout, alive,
                  lambda: f"no message arrived (reader {self.reader} waits for part {want})")
            _, length, after = _HEADER.unpack_from(self.buf, base)
            start = base + _HEADER.size + self.readers
            chunks.append(bytes(self.buf[start:start + length]))
            self.buf[base + _HEADER.size + self.reader] = 1
            self.next_part += 1
            if not after:
                return pickle.loads(b"".join(chunks))

    def close(self) -> None:
        """Detach; the writer also frees the memory. Idempotent."""
        if self.buf is None:
            return
        self.buf.release()
        self.buf = None
        self.shm.close()
        if self.reader is None:
            self.shm.unlink()


def _wait(ready: Callable[[], bool], timeout: float, alive: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    sleep = 0.0
    while not ready():
        if not alive():
            raise RuntimeError(f"the other side of the broadcast is gone: {what()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what()} within {timeout} s")
        time.sleep(sleep)
        sleep = min(_MAX_SLEEP_S, sleep * 2 + 1e-5)
