"""Resumes and explicit stops of resumable streams (``on_client_gone: detach``).

:class:`ResumeService` is the sidecar's side of :mod:`streamwarden.resume`:
it opens a journal for each new stream of a resumable route, serves a
request that carries a position (``Last-Event-ID`` or ``?last_event_id=``)
from the store, never from the upstream, and stops a stream on ``DELETE``.

A resume is served in three parts: the events after the client's position
from the store, then the rest live as the original stream writes them (on
this replica or, with Redis, another), then the end the original had (its
terminal event or the same synthesized error, both stored like any event).
While it reads, the resumed client holds a lease on the stream, so a
detached stream is not closed under it at the end of its
``resume_window``.

The answers a resume can get instead (all ``200 text/event-stream`` with
one error event in the stream's dialect, which clients and SDKs raise on):
``resume_expired`` (unknown, expired, or other credentials than the
original's: the same answer, so nobody learns that a stream exists),
``resume_gap`` (the position was already evicted: the client must know it
lost text) and ``resume_unavailable`` (the store could not be asked). A
resume at the end of a finished stream gets ``204``, which also stops a
browser's ``EventSource`` from reconnecting.

The backends share one interface (:class:`ResumeBackend`): the in-process
:class:`MemoryBackend` here, :class:`~streamwarden.sidecar.resume_redis.RedisBackend`
for many replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.dialects import SSE_MEDIA_TYPE, Dialect, detect
from streamwarden.headers import stream_response_headers
from streamwarden.metrics import StreamMetrics
from streamwarden.refusals import RefusalKind
from streamwarden.relay import KEEPALIVE, ErrorCode
from streamwarden.resume import (
    STREAM_ID_HEADER,
    Journal,
    JournalSink,
    MemoryStore,
    Position,
    ResumeResult,
    new_stream_id,
    owner_digest,
    resume_position,
    same_owner,
)
from streamwarden.sidecar.http import CLIENT_GONE, refuse

__all__ = ["Batch", "MemoryBackend", "ResumeBackend", "ResumeService", "StoreUnavailable"]

log = logging.getLogger("streamwarden.resume")


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

    def _now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def open(self, stream_id: str, owner: str, dialect: str) -> JournalSink | None:
        return self.store.open(stream_id, owner, dialect)

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

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


def _dialect_for(setting: str, path: str) -> Dialect:
    found = detect(setting, path=path, content_type=SSE_MEDIA_TYPE, headers={}, framing="sse")
    return found.dialect


_REASONS = {
    ErrorCode.RESUME_EXPIRED: "the stream to resume is unknown or has expired",
    ErrorCode.RESUME_GAP: "the events after the resume position are no longer kept",
    ErrorCode.RESUME_UNAVAILABLE: "the resume store is unavailable",
}


@dataclass(frozen=True, slots=True)
class _LocalStream:
    """A resumable stream running in this process."""

    #: The digest of its request's credentials.
    owner: str
    #: Ends it now (an explicit stop).
    stop: Callable[[], None]
    #: Tells it a client resumed (what it generates is not for nobody).
    resumed: Callable[[], None]


# What each refused resume is told: a denied one exactly what an unknown one is.
_CODES = {
    ResumeResult.EXPIRED: ErrorCode.RESUME_EXPIRED,
    ResumeResult.DENIED: ErrorCode.RESUME_EXPIRED,
    ResumeResult.GAP: ErrorCode.RESUME_GAP,
    ResumeResult.UNAVAILABLE: ErrorCode.RESUME_UNAVAILABLE,
}


class ResumeService:
    """Journals for new streams, resumes and stops, over one backend."""

    def __init__(self, settings: Settings, metrics: StreamMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.backend: ResumeBackend
        if settings.resume_store == "memory":
            self.backend = MemoryBackend(settings)
        else:
            from streamwarden.sidecar.resume_redis import RedisBackend

            self.backend = RedisBackend(settings.resume_store, settings, metrics)
        #: Streams running in this process, by stream id.
        self._local: dict[str, _LocalStream] = {}
        if metrics is not None:
            metrics.store_bytes.set_function(lambda: float(self.backend.bytes_held() or 0))

    async def start(self) -> None:
        await self.backend.start()

    async def close(self) -> None:
        await self.backend.close()

    # -- the original stream -----------------------------------------------------

    def journal(self, request: web.Request, dialect: str) -> Journal | None:
        """A journal for a new stream of a resumable route (``None``: not kept now)."""
        stream_id = new_stream_id()
        owner = self._owner(request, stream_id)
        sink = self.backend.open(stream_id, owner, dialect)
        if sink is None:
            return None
        return Journal(stream_id, sink)

    def running(
        self,
        journal: Journal,
        request: web.Request,
        stop: Callable[[], None],
        resumed: Callable[[], None],
    ) -> None:
        """The stream runs here: its owner's ``DELETE`` calls ``stop``, a resume ``resumed``."""
        owner = self._owner(request, journal.stream_id)
        self._local[journal.stream_id] = _LocalStream(owner, stop, resumed)

    def finished(self, journal: Journal) -> None:
        self._local.pop(journal.stream_id, None)

    async def held_for(self, stream_id: str) -> float | None:
        """Seconds a resumed client still holds the stream for, or ``None``."""
        try:
            return await self.backend.held_for(stream_id)
        except StoreUnavailable:
            return None

    # -- requests ----------------------------------------------------------------

    @staticmethod
    def position(request: web.Request) -> Position | str | None:
        """The position the request resumes from (see :func:`resume_position`)."""
        return resume_position(request.headers.get("Last-Event-ID"), request.query_string)

    async def stop(self, request: web.Request, asked: Position | str | None) -> web.Response:
        """``DELETE`` with a position or the stream id header: stop the stream now."""
        stream_id = asked.stream_id if isinstance(asked, Position) else None
        if stream_id is None:
            named = request.headers.get(STREAM_ID_HEADER, "").strip().lower()
            stream_id = named or None
        local = self._local.get(stream_id) if stream_id else None
        if stream_id is None or local is None:
            return refuse(RefusalKind.UNKNOWN_STREAM)
        if not same_owner(local.owner, self._owner(request, stream_id)):
            return refuse(RefusalKind.UNKNOWN_STREAM)  # as if unknown: nothing to learn
        local.stop()
        return web.Response(status=204)

    async def serve(
        self, request: web.Request, route: ResolvedRoute, asked: Position | str
    ) -> web.StreamResponse:
        """Answer a resume from the store: replay, then live, then the original's end."""
        dialect = _dialect_for(route.dialect, request.path)
        if not isinstance(asked, Position):
            return await self._refuse(request, dialect, ResumeResult.EXPIRED)
        stream_id = asked.stream_id
        backend = self.backend
        try:
            found = await backend.lookup(stream_id)
        except StoreUnavailable:
            return await self._refuse(request, dialect, ResumeResult.UNAVAILABLE)
        if found is None:
            return await self._refuse(request, dialect, ResumeResult.EXPIRED)
        owner, stored_dialect = found
        if not same_owner(owner, self._owner(request, stream_id)):
            # The same answer as an unknown stream: nobody learns it exists.
            return await self._refuse(request, dialect, ResumeResult.DENIED)
        dialect = _dialect_for(stored_dialect, request.path)
        window = route.resume_window
        wait = min(route.limits.keepalive_interval or 15.0, max(window / 3, 0.05))
        try:
            await backend.hold(stream_id, window)
            first = await backend.read(stream_id, asked.seq, 0)
        except StoreUnavailable:
            return await self._refuse(request, dialect, ResumeResult.UNAVAILABLE)
        if first is None:
            return await self._refuse(request, dialect, ResumeResult.EXPIRED)
        if first.gap:
            return await self._refuse(request, dialect, ResumeResult.GAP)
        if first.ended and not first.events:
            self._count(ResumeResult.OK)
            return web.Response(status=204)  # nothing after it: EventSource stops here
        self._count(ResumeResult.OK)
        local = self._local.get(stream_id)
        if local is not None:
            local.resumed()  # the original, on this replica, learns it now
        response = self._prepare_stream(stream_id)
        await response.prepare(request)
        batch: Batch | None = first
        position = asked.seq
        try:
            while batch is not None:
                if batch.gap:
                    await response.write(dialect.error_event(*self._error(ErrorCode.RESUME_GAP)))
                    break
                if batch.events:
                    await response.write(b"".join(batch.events))
                    position += len(batch.events)
                    if self.metrics is not None:
                        self.metrics.replayed.inc(len(batch.events))
                if batch.ended:
                    break
                if not batch.events and batch is not first:
                    await response.write(KEEPALIVE)
                try:
                    await backend.hold(stream_id, window)
                    batch = await backend.read(stream_id, position, wait)
                except StoreUnavailable:
                    error = self._error(ErrorCode.RESUME_UNAVAILABLE)
                    await response.write(dialect.error_event(*error))
                    break
            if batch is None:
                await response.write(dialect.error_event(*self._error(ErrorCode.RESUME_EXPIRED)))
            with contextlib.suppress(*CLIENT_GONE):
                await response.write_eof()
        except CLIENT_GONE:
            pass  # the resumed client left too; the lease runs out by itself
        return response

    # -- internals -----------------------------------------------------------------

    def _owner(self, request: web.Request, stream_id: str) -> str:
        return owner_digest(request.headers.items(), stream_id, self.settings.resume_owner_headers)

    def _count(self, result: ResumeResult) -> None:
        if self.metrics is not None:
            self.metrics.resumes.labels(str(result)).inc()

    @staticmethod
    def _error(code: ErrorCode) -> tuple[str, str]:
        return str(code), f"streamwarden: {_REASONS[code]} ({code})"

    @staticmethod
    def _prepare_stream(stream_id: str | None) -> web.StreamResponse:
        response = web.StreamResponse(status=200)
        committed = {"Content-Type": "text/event-stream; charset=utf-8"}
        for name, value in stream_response_headers(committed.items()):
            response.headers.add(name, value)
        if stream_id is not None:
            response.headers[STREAM_ID_HEADER] = stream_id
        return response

    async def _refuse(
        self, request: web.Request, dialect: Dialect, result: ResumeResult
    ) -> web.StreamResponse:
        self._count(result)
        code = _CODES[result]
        response = self._prepare_stream(None)
        with contextlib.suppress(*CLIENT_GONE):
            await response.prepare(request)
            await response.write(dialect.error_event(*self._error(code)))
            await response.write_eof()
        return response
