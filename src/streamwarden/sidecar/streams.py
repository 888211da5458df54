"""The sidecar's register of streams (:class:`~streamwarden.observation.register.StreamRegister`).

On top of what both faces share, the sidecar's drain needs the streams in
flight (to give each its deadline) and a wait for the last one to end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from streamwarden.core.meter import StreamRecord
from streamwarden.core.relay import Relay
from streamwarden.observation.register import StreamRegister

__all__ = ["ActiveStream", "StreamRecord", "StreamTracker"]


class Sleeper(Protocol):
    """The stream's task, while it waits for the relay's deadline."""

    def deadline_now(self) -> None:
        """Act on the relay's deadline now, as if it had passed."""


@dataclass(slots=True, eq=False)
class ActiveStream:
    """A stream in flight; ``wake`` makes its task look at the relay's deadline again."""

    stream_id: str
    relay: Relay
    #: The matched route prefix (the metrics label).
    route: str = "/"
    #: Set while the stream's task waits for the relay's deadline.
    sleeper: Sleeper | None = field(default=None, repr=False)
    #: The client is not taking our writes (its transport is over its mark).
    paused: bool = False

    def wake(self) -> None:
        """Run the stream's timer now (its deadline moved sooner: the drain)."""
        if self.sleeper is not None:
            self.sleeper.deadline_now()


class StreamTracker(StreamRegister[ActiveStream]):
    """The sidecar's register: it also waits for the last stream, and gives drain deadlines."""

    def __init__(self, keep: int = 1000) -> None:
        super().__init__(keep)
        self._idle = asyncio.Event()
        self._idle.set()
        self.on_idle.append(self._idle.set)
        #: Set once the process drains: every stream, open or new, ends by then.
        self.drain_deadline: float | None = None

    def open(self, stream: ActiveStream) -> None:
        super().open(stream)
        self._idle.clear()
        if self.drain_deadline is not None:
            stream.relay.drain_by(self.drain_deadline)

    def drain_by(self, deadline: float) -> None:
        """Every stream in flight, and every one that opens from now on, ends by ``deadline``."""
        self.drain_deadline = deadline
        for stream in list(self.active):
            stream.relay.drain_by(deadline)
            stream.wake()

    async def wait_idle(self) -> None:
        """Return once no stream is in flight."""
        await self._idle.wait()
