"""Stores of resumable streams, as both faces use them (async, no web framework).

:class:`ResumeBackend` is what a face asks of a store: a sink for a new
stream's journal (never awaited: a stream's events never wait on a store),
the one write its head waits for (a shared store's: the head names the
stream, which a resume anywhere must then find), the owner and dialect of
a stream, its events after a position (waiting a while for the next one,
for a live continuation), and a hold that a resumed client keeps on the
stream while it reads, so that a detached stream is not closed under it
at the end of its ``resume_window``.

Two backends: :class:`MemoryBackend` (the bounded in-process
:class:`~streamwarden.features.resume.model.MemoryStore`; a client resumes only where it
started) and :class:`~streamwarden.features.resume.redis_store.RedisBackend` (shared by
replicas), which builds on this module's interface. The one that picks
between them from ``resume_store`` is
:func:`streamwarden.features.resume.service.open_backend`, above both, so that
neither backend imports the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from streamwarden.config import Settings
from streamwarden.core.journal import JournalSink
from streamwarden.features.resume.model import MemoryStore

__all__ = ["Batch", "MemoryBackend", "ResumeBackend", "StoreUnavailable"]


class StoreUnavailable(Exception):
    """The resume store could not be asked (Redis down or too slow)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """What a read of a stored stream found after a position."""

    #: The next events, in order, with no hole between them and the position.
    events: list[bytes]
    #: The stream ended and ``events`` reach its last one.
    ended: bool = False
    #: The events right after the position were already evicted.
    gap: bool = False


class ResumeBackend(Protocol):
    """A store of resumable streams, as the sidecar uses it."""

    def open(self, stream_id: str, owner: str, dialect: str) -> JournalSink | None:
        """A sink for a new stream's journal, or ``None`` if it cannot be kept now."""
        ...

    def storing(self, stream_id: str) -> Awaitable[bool] | None:
        """The write that lets a resume find a stream just opened, if still under way.

        A stream's head names its id, so the head waits for it: a resume
        sent the instant after must find the stream, on any replica. It
        settles within a bound (False: not stored in time); ``None``: the
        stream is findable already.
        """
        ...

    async def lookup(self, stream_id: str) -> tuple[str, str] | None:
        """The stream's owner digest and dialect, or ``None`` if unknown or expired."""
        ...

    async def read(self, stream_id: str, after: int, wait: float) -> Batch | None:
        """The events after ``after``, waiting up to ``wait`` s for one; ``None``: gone."""
        ...

    async def hold(self, stream_id: str, seconds: float) -> None:
        """A resumed client reads the stream: keep it running ``seconds`` more."""
        ...

    async def held_for(self, stream_id: str) -> float | None:
        """Seconds left on the latest hold of the stream, or ``None`` if none."""
        ...

    def bytes_held(self) -> int | None:
        """Bytes of events this process holds (``None``: held elsewhere)."""
        ...

    async def request_stop(self, stream_id: str) -> bool:
        """Ask every replica to stop the stream (it runs elsewhere); False if none can be asked."""
        ...

    #: Called with a stream id that another replica asked to stop.
    on_stop: Callable[[str], None] | None

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class MemoryBackend:
    """The bounded in-process store: resumes reach only this replica."""

    def __init__(self, settings: Settings) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.store = MemoryStore(
            max_stream_bytes=settings.resume_max_bytes,
            max_total_bytes=settings.resume_max_total_bytes,
            ttl=settings.resume_ttl,
            clock=self._now,
        )
        self._holds: dict[str, float] = {}
        self.on_stop: Callable[[str], None] | None = None

    def _now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def open(self, stream_id: str, owner: str, dialect: str) -> JournalSink | None:
        return self.store.open(stream_id, owner, dialect)

    def storing(self, stream_id: str) -> Awaitable[bool] | None:
        return None  # in the store as it opened: nothing to wait for

    async def lookup(self, stream_id: str) -> tuple[str, str] | None:
        stored = self.store.find(stream_id)
        return None if stored is None else (stored.owner, stored.dialect)

    async def read(self, stream_id: str, after: int, wait: float) -> Batch | None:
        stored = self.store.find(stream_id)
        if stored is None:
            return None
        events = stored.after(after)
        if events is None:
            return Batch([], gap=True)
        if not events and stored.ended is None and wait > 0:
            changed = asyncio.get_running_loop().create_future()

            def wake() -> None:
                if not changed.done():
                    changed.set_result(None)

            stored.listen(wake)
            try:
                await asyncio.wait({changed}, timeout=wait)
            finally:
                stored.unlisten(wake)
            return await self.read(stream_id, after, 0)
        ended = stored.ended is not None and after + len(events) >= stored.last_seq
        return Batch(events, ended=ended)

    async def hold(self, stream_id: str, seconds: float) -> None:
        self._holds[stream_id] = self._now() + seconds
        if len(self._holds) > 2 * (len(self.store) + 16):
            now = self._now()
            self._holds = {k: v for k, v in self._holds.items() if v > now}

    async def held_for(self, stream_id: str) -> float | None:
        until = self._holds.get(stream_id)
        if until is None:
            return None
        left = until - self._now()
        return left if left > 0 else None

    def bytes_held(self) -> int | None:
        return self.store.total_bytes

    async def request_stop(self, stream_id: str) -> bool:
        return False  # one process: a stream not running here runs nowhere

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
