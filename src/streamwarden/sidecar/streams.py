"""The sidecar's register of streams: the ones in flight and the recently finished.

Drain needs the streams in flight (to tell them to end), metrics need the
count, and tests and the operations layer need each finished stream's
record. Listeners registered here see every record exactly once, when its
stream ends.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streamwarden.meter import StreamRecord
from streamwarden.relay import Relay

__all__ = ["ActiveStream", "StreamRecord", "StreamTracker"]


@dataclass(slots=True, eq=False)
class ActiveStream:
    """A stream in flight; ``wake`` interrupts its wait for the upstream."""

    stream_id: str
    relay: Relay
    draining: bool = False
    timer: asyncio.Timeout | None = field(default=None, repr=False)
    #: Closes the upstream side at once (set by the face once it has one).
    on_close: Callable[[], object] | None = field(default=None, repr=False)

    def wake(self) -> None:
        """Make the stream's loop run now (used to tell it the process is draining)."""
        timer = self.timer
        if timer is not None and not timer.expired():
            timer.reschedule(asyncio.get_running_loop().time())


Listener = Callable[[StreamRecord], None]


class StreamTracker:
    """Streams in flight and the last ``keep`` finished ones."""

    def __init__(self, keep: int = 1000) -> None:
        self.active: set[ActiveStream] = set()
        self.finished: deque[StreamRecord] = deque(maxlen=keep)
        self.listeners: list[Listener] = []
        self._ids = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()

    def next_id(self) -> str:
        return f"{next(self._ids):x}"

    def open(self, stream: ActiveStream) -> None:
        self.active.add(stream)
        self._idle.clear()

    def close(self, stream: ActiveStream, record: StreamRecord) -> None:
        self.active.discard(stream)
        self.finished.append(record)
        for listener in self.listeners:
            listener(record)
        if not self.active:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no stream is in flight."""
        await self._idle.wait()
