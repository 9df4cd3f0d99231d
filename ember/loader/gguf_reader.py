"""The GGUF container: header, metadata and tensor table, read from a memory map.

ember's own reader rather than gguf-py's GGUFReader: that one builds a numpy view for every
element of every array, and the default model's vocabulary (49,152 tokens, their scores and
types, 48,900 merges) took it 3.5 s of the 5 s a start took; this one reads it in ~0.1 s
(benchmarks/BENCHMARKS.md). gguf-py still names the types and decodes the K-quants.

    GGUF v2/v3, little-endian:
    | "GGUF" | version u32 | tensors u64 | keys u64 | key/values ... | tensor infos ... | pad | data
    key/value:   key (string) | type u32 | value     string: length u64 | UTF-8 bytes
    array value: item type u32 | count u64 | items
    tensor info: name (string) | dims u32 | ne u64 x dims (fastest first) | type u32 | offset u64
    data starts at the first multiple of general.alignment (32) after the infos; offsets count from it
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class CorruptGGUF(ValueError):
    """The bytes do not parse as GGUF (truncated, or not GGUF past the magic)."""


@dataclass(frozen=True)
class RawTensor:
    name: str
    ne: tuple[int, ...]  # GGUF order: fastest dimension first
    qtype: int
    offset: int  # absolute, in the file


@dataclass
class RawGGUF:
    version: int
    metadata: dict[str, Any]
    tensors: list[RawTensor]
    data_offset: int
    buffer: mmap.mmap  # the file, read-only


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CorruptGGUF(f"needs {n} bytes at offset {self.pos}, past the end ({len(self.buf)} bytes)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, key: str) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"metadata {key!r} holds a string that is not UTF-8 ({e})") from None

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string(key)
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                return np.frombuffer(self.take(count * dtype.itemsize), dtype).tolist()
            if item == _STRING:
                return [self.string(key) for _ in range(count)]
            if item == _ARRAY:
                return [v for _ in range(count) for v in self.value(_ARRAY, key)]  # flattened, as gguf-py does
        raise CorruptGGUF(f"metadata {key!r} has an unknown value type {kind}")


def read_gguf(path: Path) -> RawGGUF:
    """Parse the file's header, metadata and tensor table; CorruptGGUF where the bytes are not
    GGUF, ValueError for a big-endian file."""
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else None
    if buffer is None:
        raise CorruptGGUF("the file is empty")
    cur = _Cursor(memoryview(buffer))
    cur.take(4)  # the magic, checked by the caller
    version = cur.scalar("<I")
    if version and (version & 0xFFFF) == 0:
        raise ValueError("the file was written for the other byte order (big-endian); ember reads little-endian "
                         "GGUF files only. Convert the model again on a little-endian machine.")
    if version not in (2, 3):
        raise CorruptGGUF(f"GGUF version {version}; ember reads versions 2 and 3")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a key")
        metadata[key] = cur.value(cur.scalar("<I"), key)
    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        dims = cur.scalar("<I")
        if dims > 8:
            raise CorruptGGUF(f"tensor {name!r} has {dims} dimensions")
        ne = tuple(cur.scalar("<Q") for _ in range(dims))
        infos.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise CorruptGGUF(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = [RawTensor(name, ne, qtype, data_offset + offset) for name, ne, qtype, offset in infos]
    return RawGGUF(version, metadata, tensors, data_offset, buffer)
