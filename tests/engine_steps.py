"""Driving an engine core step by step in the tests."""

from __future__ import annotations

from collections.abc import Callable

from ember.request import Request


def abort_one_when(core, requests: list[Request], ready: Callable[[Request], bool]) -> Request:
    """Add the requests, step until one of them is `ready`, abort that one and run the rest to
    their end; returns the aborted one."""
    for r in requests:
        core.add_request(r)
    while not any(ready(r) for r in requests):
        core.step()
    gone = next(r for r in requests if ready(r))
    core.abort_request(gone.request_id)
    while core.has_unfinished_requests():
        core.step()
    return gone
