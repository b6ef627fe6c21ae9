"""Waiting on a condition with a deadline, never a bare sleep: in a test thread, or in a trio task."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 120.0, every: float = 0.2) -> T:
    """``check()``'s first truthy value within ``timeout`` seconds; else an AssertionError naming ``what``.
    ``check`` may itself assert (a process that died) to fail at once."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


async def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Return once ``predicate()`` holds (polled every 20 ms), or fail after ``timeout`` seconds naming ``what``."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
