"""Resumes and explicit stops of resumable streams, for both faces.

:class:`ResumeService` is what a face holds when some route has
``on_client_gone: detach``: it opens a journal for each new stream of such
a route, answers a request that carries a position (``Last-Event-ID`` or
``?last_event_id=``) from the store, never from the upstream or the app,
and stops a running stream on its owner's ``DELETE``. A face only adapts
its own request and response objects (:class:`Answer`).

A resume is served in three parts: the events after the client's position
from the store, then the rest live as the original stream writes them (on
this replica or, with Redis, another), then the end the original had (its
terminal event or the same synthesized error, both stored like any event).
While it reads, the resumed client holds the stream, so a detached stream
is not closed under it at the end of its ``resume_window``.

The answers a resume can get instead (all ``200 text/event-stream`` with
one error event in the stream's dialect, which clients and SDKs raise on):
``resume_expired`` (unknown, expired, or other credentials than the
original's: the same answer, so nobody learns that a stream exists),
``resume_gap`` (the position was already evicted: the client must know it
lost text) and ``resume_unavailable`` (the store could not be asked). A
resume at the end of a finished stream gets ``204``, which also stops a
browser's ``EventSource`` from reconnecting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.dialects import SSE_MEDIA_TYPE, Dialect, detect
from streamwarden.core.headers import stream_response_headers
from streamwarden.core.journal import Journal
from streamwarden.core.relay import KEEPALIVE, ErrorCode
from streamwarden.features.resume.model import (
    STREAM_ID_HEADER,
    OwnerNames,
    Position,
    ResumeResult,
    new_stream_id,
    owner_digest,
    parse_stream_id,
    resume_position,
    same_owner,
)
from streamwarden.features.resume.store import Batch, MemoryBackend, ResumeBackend, StoreUnavailable
from streamwarden.observation.metrics import StreamMetrics

__all__ = ["Answer", "ResumeService", "open_backend"]

Headers = Iterable[tuple[str, str]]


class Answer(Protocol):
    """A face's response to a resume: start it, write to it, end it.

    ``write`` raises whatever the face raises for a client that left; the
    face catches it around :meth:`ResumeService.serve`.
    """

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish(self) -> None: ...


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
_REASONS = {
    ErrorCode.UPSTREAM_TIMEOUT: "the stream to resume made no progress for too long",
    ErrorCode.RESUME_EXPIRED: "the stream to resume is unknown or has expired",
    ErrorCode.RESUME_GAP: "the events after the resume position are no longer kept",
    ErrorCode.RESUME_UNAVAILABLE: "the resume store is unavailable",
}


def _dialect_for(setting: str, path: str) -> Dialect:
    found = detect(setting, path=path, content_type=SSE_MEDIA_TYPE, headers={}, framing="sse")
    return found.dialect


def _error_event(dialect: Dialect, code: ErrorCode) -> bytes:
    return dialect.error_event(str(code), f"streamwarden: {_REASONS[code]} ({code})")


#: Most bytes of replayed events written at once (the hold is renewed between).
_PIECE = 64 * 1024


def _pieces(events: list[bytes]) -> list[list[bytes]]:
    pieces: list[list[bytes]] = [[]]
    size = 0
    for event in events:
        if size and size + len(event) > _PIECE:
            pieces.append([])
            size = 0
        pieces[-1].append(event)
        size += len(event)
    return pieces


def _stream_headers(stream_id: str | None) -> list[tuple[str, str]]:
    committed = [("Content-Type", "text/event-stream; charset=utf-8")]
    headers = stream_response_headers(committed)
    if stream_id is not None:
        headers.append((STREAM_ID_HEADER, stream_id))
    return headers


def open_backend(settings: Settings, metrics: StreamMetrics | None = None) -> ResumeBackend:
    """The store ``resume_store`` names (Redis is imported only when asked for)."""
    if settings.resume_store == "memory":
        return MemoryBackend(settings)
    from streamwarden.features.resume.redis_store import RedisBackend

    return RedisBackend(settings.resume_store, settings, metrics)


class ResumeService:
    """Journals for new streams, resumes and stops, over one store."""

    def __init__(self, settings: Settings, metrics: StreamMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.backend: ResumeBackend = open_backend(settings, metrics)
        #: Where a request's credentials are: what makes a stream's owner.
        self._owner_names = OwnerNames.of(
            settings.resume_owner_headers, settings.resume_owner_query_params
        )
        #: Streams running in this process, by stream id.
        self._local: dict[str, _LocalStream] = {}
        self._started = False
        self.backend.on_stop = self._stop_here
        if metrics is not None:
            metrics.store_bytes.set_function(lambda: float(self.backend.bytes_held() or 0))

    @staticmethod
    def wanted(settings: Settings) -> bool:
        """Some route keeps its streams for a resume."""
        return settings.on_client_gone == "detach" or any(
            route.on_client_gone == "detach" for route in settings.routes.values()
        )

    async def start(self) -> None:
        await self.backend.start()
        self._started = True

    async def ensure_started(self) -> None:
        """Start the store on first use (an ASGI app has no start hook of ours)."""
        if not self._started:
            self._started = True
            await self.backend.start()

    async def close(self) -> None:
        await self.backend.close()

    # -- the original stream -----------------------------------------------------

    def journal(self, headers: Headers, query_string: str, dialect: str) -> Journal | None:
        """A journal for a new stream of a resumable route (``None``: not kept now)."""
        stream_id = new_stream_id()
        sink = self.backend.open(stream_id, self._owner(headers, query_string, stream_id), dialect)
        return None if sink is None else Journal(stream_id, sink)

    def storing(self, journal: Journal) -> Awaitable[bool] | None:
        """What the stream's head waits for: the store able to answer a resume of it.

        ``None`` when it already is (the memory store); with Redis, the
        write of its owner, bounded (see :meth:`ResumeBackend.storing`).
        Awaited once, by the face.
        """
        return self.backend.storing(journal.stream_id)

    def running(
        self,
        journal: Journal,
        headers: Headers,
        query_string: str,
        stop: Callable[[], None],
        resumed: Callable[[], None],
    ) -> None:
        """The stream runs here: its owner's ``DELETE`` calls ``stop``, a resume ``resumed``."""
        owner = self._owner(headers, query_string, journal.stream_id)
        self._local[journal.stream_id] = _LocalStream(owner, stop, resumed)

    def finished(self, journal: Journal, end_state: str, dialect: str) -> None:
        """The stream ended: its store entry says how, for a resume."""
        journal.end(end_state, dialect)
        self._local.pop(journal.stream_id, None)

    def runs_here(self, asked: Position | str) -> bool:
        """Whether the stream a resume asks for is running in this process (it holds a slot)."""
        return isinstance(asked, Position) and asked.stream_id in self._local

    async def held_for(self, stream_id: str) -> float | None:
        """Seconds a resumed client still holds the stream for, or ``None``."""
        try:
            return await self.backend.held_for(stream_id)
        except StoreUnavailable:
            return None

    # -- requests ----------------------------------------------------------------

    @staticmethod
    def position(last_event_id: str | None, query_string: str) -> Position | str | None:
        """The position a request resumes from (see :func:`resume_position`)."""
        return resume_position(last_event_id, query_string)

    async def stop(self, headers: Headers, query_string: str, asked: Position | str | None) -> bool:
        """An owner's ``DELETE`` with a position or the stream id header; True if stopped.

        A stream running here stops at once; one running on another replica
        (Redis) is stopped there, through the store's stop channel.
        """
        pairs = list(headers)
        stream_id = asked.stream_id if isinstance(asked, Position) else None
        if stream_id is None:
            named = [v for n, v in pairs if n.lower() == STREAM_ID_HEADER.lower()]
            stream_id = parse_stream_id(named[0]) if named else None
        if not stream_id:
            return False
        local = self._local.get(stream_id)
        if local is not None:
            if not same_owner(local.owner, self._owner(pairs, query_string, stream_id)):
                return False  # as if unknown: nothing to learn
            local.stop()
            return True
        try:
            found = await self.backend.lookup(stream_id)
            owner = self._owner(pairs, query_string, stream_id)
            if found is None or not same_owner(found[0], owner):
                return False
            return await self.backend.request_stop(stream_id)
        except StoreUnavailable:
            return False

    def _stop_here(self, stream_id: str) -> None:
        """Another replica relayed an owner's stop (it checked the owner)."""
        local = self._local.get(stream_id)
        if local is not None:
            local.stop()

    async def serve(
        self,
        asked: Position | str,
        headers: Headers,
        query_string: str,
        path: str,
        route: ResolvedRoute,
        answer: Answer,
    ) -> ResumeResult:
        """Answer a resume from the store: replay, then live, then the original's end."""
        pairs = list(headers)
        dialect = _dialect_for(route.dialect, path)
        if not isinstance(asked, Position):
            return await self._refuse(answer, dialect, ResumeResult.EXPIRED)
        stream_id = asked.stream_id
        backend = self.backend
        try:
            found = await backend.lookup(stream_id)
        except StoreUnavailable:
            return await self._refuse(answer, dialect, ResumeResult.UNAVAILABLE)
        if found is None:
            return await self._refuse(answer, dialect, ResumeResult.EXPIRED)
        owner, stored_dialect = found
        if not same_owner(owner, self._owner(pairs, query_string, stream_id)):
            # The same answer as an unknown stream: nobody learns it exists.
            return await self._refuse(answer, dialect, ResumeResult.DENIED)
        dialect = _dialect_for(stored_dialect, path)
        try:
            await backend.hold(stream_id, route.resume_window)
            batch: Batch | None = await backend.read(stream_id, asked.seq, 0)
        except StoreUnavailable:
            return await self._refuse(answer, dialect, ResumeResult.UNAVAILABLE)
        if batch is None:
            return await self._refuse(answer, dialect, ResumeResult.EXPIRED)
        if batch.gap and not batch.events:
            return await self._refuse(answer, dialect, ResumeResult.GAP)
        self._count(ResumeResult.OK)
        if batch.ended and not batch.events:
            await answer.start(204, [])  # nothing after it: EventSource stops here
            await answer.finish()
            return ResumeResult.OK
        local = self._local.get(stream_id)
        if local is not None:
            local.resumed()  # the original, on this replica, learns it now
        await answer.start(200, _stream_headers(stream_id))
        await self._replay(answer, stream_id, asked.seq, batch, dialect, route)
        await answer.finish()
        return ResumeResult.OK

    async def _replay(
        self,
        answer: Answer,
        stream_id: str,
        position: int,
        batch: Batch | None,
        dialect: Dialect,
        route: ResolvedRoute,
    ) -> None:
        """Write the stored events from ``batch`` on, then the live ones, to the original's end.

        Between batches the stream is held for another ``resume_window``
        and the client gets a keep-alive; every way this can stop short
        (a hole, a silent writer, the store gone) ends with its error event.
        """
        backend = self.backend
        window = route.resume_window
        # Often enough to keep both the client (keep-alive) and the hold alive.
        wait = min(route.limits.keepalive_interval or 15.0, max(window / 3, 0.05))
        first = True
        clock = asyncio.get_running_loop()
        idle_limit = route.limits.upstream_idle_timeout
        progressed = clock.time()
        while batch is not None:
            if batch.events:
                # Whole events before a hole are still the client's: then the
                # hole. In pieces, holding the stream before each, so that a
                # long replay to a slow client does not outlast its hold.
                for piece in _pieces(batch.events):
                    await backend.hold(stream_id, window)
                    await answer.write(b"".join(piece))
                position += len(batch.events)
                progressed = clock.time()
                if self.metrics is not None:
                    self.metrics.replayed.inc(len(batch.events))
            elif idle_limit > 0 and clock.time() - progressed > idle_limit:
                # No event and no end for that long: the stream's writer is gone
                # (a replica that died, an end entry that was dropped).
                await answer.write(_error_event(dialect, ErrorCode.UPSTREAM_TIMEOUT))
                break
            if batch.gap:
                await answer.write(_error_event(dialect, ErrorCode.RESUME_GAP))
                break
            if batch.ended:
                break
            if not batch.events and not first:
                await answer.write(KEEPALIVE)
            first = False
            try:
                await backend.hold(stream_id, window)
                batch = await backend.read(stream_id, position, wait)
            except StoreUnavailable:
                await answer.write(_error_event(dialect, ErrorCode.RESUME_UNAVAILABLE))
                break
        else:
            await answer.write(_error_event(dialect, ErrorCode.RESUME_EXPIRED))

    # -- internals -----------------------------------------------------------------

    def _owner(self, headers: Headers, query_string: str, stream_id: str) -> str:
        secret = self.settings.resume_secret.get_secret_value()
        return owner_digest(headers, stream_id, self._owner_names, secret, query_string)

    def _count(self, result: ResumeResult) -> None:
        if self.metrics is not None:
            self.metrics.resumes.labels(str(result)).inc()

    async def _refuse(self, answer: Answer, dialect: Dialect, result: ResumeResult) -> ResumeResult:
        self._count(result)
        await answer.start(200, _stream_headers(None))
        await answer.write(_error_event(dialect, _CODES[result]))
        await answer.finish()
        return result
