"""The input side's image caches: BytesLRU, a least-recently-used map bounded in bytes that the
server's input threads share (its lock guards the map alone, never the work that fills it),
and `image_digest`, the key of an image by its content. The decoded images of media.py and the
processed images of processor.py live in them, so the same image sent again (in a chat's
every turn, or in every request of a batch) is neither decoded nor processed again."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class BytesLRU(Generic[V]):
    def __init__(self, max_bytes: int, size: Callable[[V], int]) -> None:
        """`size`: a value's bytes. max_bytes 0 keeps nothing."""
        self.max_bytes, self._size = max_bytes, size
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.hits = self.misses = 0  # tests, benchmarks
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        """Keep `value`, evicting the least recently used entries past max_bytes; a value over
        max_bytes by itself is not kept. Two threads that missed the same key both put it: the
        later one's stays (the values are equal)."""
        size = self._size(value)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._entries[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                self.nbytes -= self._entries.popitem(last=False)[1][1]


def image_digest(image: Any) -> bytes:
    """A PIL image's content as the model's processor sees it: its mode, size and pixels, and
    the palette and transparency its conversion to RGB reads."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}{image.size}{image.info.get('transparency')!r}".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette:
        h.update(bytes(palette))
    h.update(image.tobytes())
    return h.digest()
