"""The processes a test started, read from /proc: who is alive, who is whose child, and waiting
for them to be gone (a zombie counts as gone: it holds nothing but its exit code)."""

from __future__ import annotations

import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def parent_pid(pid: int) -> int:
    """-1 for a process that is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else -1


def children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent_pid(int(p.name)) == pid]


def descendants(pid: int) -> list[int]:
    kids = children(pid)
    return kids + [d for c in kids for d in descendants(c)]


def gone(pids: list[int], timeout: float = 30) -> bool:
    """Whether every one of `pids` is gone within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(alive(p) for p in pids)
