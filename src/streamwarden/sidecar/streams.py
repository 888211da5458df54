"""The sidecar's register of streams: the ones in flight and the recently finished.

Drain needs the streams in flight (to give each its deadline), metrics need
the count, and tests and the operations layer need each finished stream's
record. Listeners registered here see every record exactly once, when its
stream ends; one that raises is logged and the others still run, so a
broken listener can never stall the drain (which waits for the register to
empty).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streamwarden.meter import StreamRecord
from streamwarden.relay import Relay

__all__ = ["ActiveStream", "StreamRecord", "StreamTracker"]

log = logging.getLogger("streamwarden.sidecar")


@dataclass(slots=True, eq=False)
class ActiveStream:
    """A stream in flight; ``wake`` makes its task look at the relay's deadline again."""

    stream_id: str
    relay: Relay
    #: The matched route prefix (the metrics label).
    route: str = "/"
    timer: asyncio.Timeout | None = field(default=None, repr=False)

    def wake(self) -> None:
        """Run the stream's timer now (its deadline moved sooner: the drain)."""
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
        #: Set once the process drains: every stream, open or new, ends by then.
        self.drain_deadline: float | None = None

    def next_id(self) -> str:
        return f"{next(self._ids):x}"

    def open(self, stream: ActiveStream) -> None:
        self.active.add(stream)
        self._idle.clear()
        if self.drain_deadline is not None:
            stream.relay.drain_by(self.drain_deadline)

    def close(self, stream: ActiveStream, record: StreamRecord) -> None:
        self.active.discard(stream)
        self.finished.append(record)
        try:
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("a stream listener failed")
        finally:
            if not self.active:
                self._idle.set()

    def drain_by(self, deadline: float) -> None:
        """Every stream in flight, and every one that opens from now on, ends by ``deadline``."""
        self.drain_deadline = deadline
        for stream in list(self.active):
            stream.relay.drain_by(deadline)
            stream.wake()

    async def wait_idle(self) -> None:
        """Return once no stream is in flight."""
        await self._idle.wait()
