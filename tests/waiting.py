"""Waiting for a condition, bounded in time, in place of a fixed sleep.

A fixed sleep that stands for "by now it has happened" is a flaky test on a
busy 2-core CI machine: these helpers poll the condition itself and give up
(with the last value seen, for the failure message) only after a generous
bound that a healthy run never comes near.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL = 0.01


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Return as soon as ``condition()`` is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or condition}")
        await asyncio.sleep(POLL)


async def wait_until(
    probe: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = ""
) -> None:
    """:func:`wait_for` a condition that takes I/O to check (a request to ``/readyz``)."""
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or probe}")
        await asyncio.sleep(POLL)


async def wait_until_settled(read: Callable[[], T], quiet: float = 0.5, timeout: float = 30.0) -> T:
    """Return ``read()`` once it has stopped changing for ``quiet`` seconds.

    For "the buffers between are full": a counter that keeps growing means
    they are not yet, however long that takes on a loaded machine (loopback
    socket buffers autotune to megabytes); ``timeout`` bounds the wait, and
    failing it means the value never settled (nothing held it back).
    """
    deadline = time.monotonic() + timeout
    value = read()
    stable_since = time.monotonic()
    while True:
        await asyncio.sleep(POLL)
        now = time.monotonic()
        current = read()
        if current != value:
            value, stable_since = current, now
        elif now - stable_since >= quiet:
            return value
        if now > deadline:
            raise AssertionError(f"still changing after {timeout} s (last: {value!r})")
