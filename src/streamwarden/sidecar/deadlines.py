"""One loop timer for the deadlines of every stream of a sidecar process.

Each stream's task waits for its relay's next deadline (a keep-alive, the
idle timeout, the drain). A loop timer of its own per stream was about
0.6 KiB of every idle stream on uvloop (its handle, the libuv timer and
the callback); here a stream's wait is one small entry in a heap, and
the loop has one timer, for the earliest of them.

An entry that is no longer wanted (its stream woke for something else, or
ended) is only marked: it leaves the heap when its time comes, or when the
marked ones outnumber the live ones (so a churn of short streams cannot
grow the heap past twice the streams waiting).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Protocol

__all__ = ["Deadlines", "Wait"]


class Waiter(Protocol):
    def deadline_now(self) -> None:
        """The deadline it waited for has come."""


class Wait:
    """One stream's wait in the heap; :meth:`cancel` once it is over."""

    __slots__ = ("order", "waiter", "when")

    def __init__(self, when: float, order: int, waiter: Waiter) -> None:
        self.when = when
        self.order = order
        self.waiter: Waiter | None = waiter

    def __lt__(self, other: Wait) -> bool:
        return (self.when, self.order) < (other.when, other.order)


class Deadlines:
    """The waits of a process's streams, on one loop timer."""

    __slots__ = ("_cancelled", "_count", "_heap", "_loop", "_time", "_timer", "_timer_at")

    def __init__(self) -> None:
        self._heap: list[Wait] = []
        self._count = itertools.count()
        self._cancelled = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._time: Callable[[], float] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def clock(self) -> Callable[[], float]:
        """The loop's clock, one bound method for every stream (not one object per stream)."""
        time = self._time
        if time is None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            time = self._time = self._loop.time
        return time

    def __len__(self) -> int:
        """The waits still wanted."""
        return len(self._heap) - self._cancelled

    def at(self, when: float, waiter: Waiter) -> Wait:
        """Call ``waiter.deadline_now()`` once ``when`` (loop time) has come."""
        wait = Wait(when, next(self._count), waiter)
        heapq.heappush(self._heap, wait)
        if when < self._timer_at:
            self._arm(when)
        return wait

    def cancel(self, wait: Wait) -> None:
        if wait.waiter is None:
            return
        wait.waiter = None
        self._cancelled += 1
        if self._cancelled > 64 and self._cancelled > len(self._heap) // 2:
            self._heap = [w for w in self._heap if w.waiter is not None]
            heapq.heapify(self._heap)
            self._cancelled = 0

    def _arm(self, when: float) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        assert self._loop is not None
        # A loop timer may fire a little early: what is due within its
        # granularity is due (the relay's poll then finds what really is).
        now = self._loop.time() + 0.001
        heap = self._heap
        # Bounded: each entry leaves the heap once, and only those due now.
        while heap and heap[0].when <= now:
            wait = heapq.heappop(heap)
            waiter = wait.waiter
            if waiter is None:
                self._cancelled -= 1
                continue
            wait.waiter = None
            waiter.deadline_now()
        while heap and heap[0].waiter is None:  # the next live one arms the timer
            heapq.heappop(heap)
            self._cancelled -= 1
        if heap:
            self._arm(heap[0].when)
