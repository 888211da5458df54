"""Resumable streams, with no I/O: positions, owners, the memory store.

On a route with ``on_client_gone: detach`` every event the relay forwards
gets an ``id: <stream id>.<seq>`` field (the stream id is 128 random bits)
and is written to the stream's journal, whether or not its client is still
there; the journal is the core's (:mod:`streamwarden.core.journal`, re-exported
here), since the relay writes it. A client that lost its connection asks
again with ``Last-Event-ID: <stream id>.<n>`` (what a browser's
``EventSource`` sends by itself) or ``?last_event_id=`` and is served the
events after ``n`` from the store, then the rest live, never a second
generation.

Only the owner may resume: the store keeps a keyed digest of the original
request's credentials (:func:`owner_digest`), and a resume that does not
present the same ones is told exactly what it would be told of a stream
that never existed.

The store is behind the :class:`~streamwarden.core.journal.JournalSink`
protocol: the bounded in-process :class:`MemoryStore` here, or Redis
(:mod:`streamwarden.features.resume.redis_store`), whose writes are queued off the
stream's path.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import parse_qsl

# The journal moved to the core; its names stay importable from here.
from streamwarden.core.headers import (
    CREDENTIAL_HEADERS,
    CREDENTIAL_QUERY_PARAMETERS,
    credential_parts,
)
from streamwarden.core.journal import Journal, JournalSink, stamp, strip_ids

__all__ = [
    "DEFAULT_OWNER_NAMES",
    "OWNER_HEADERS",
    "OWNER_QUERY_PARAMS",
    "STREAM_ID_HEADER",
    "Journal",
    "JournalSink",
    "MemoryStore",
    "OwnerNames",
    "Position",
    "ResumeResult",
    "StoredStream",
    "new_stream_id",
    "owner_digest",
    "parse_stream_id",
    "resume_position",
    "stamp",
    "strip_ids",
]

#: The response header that names a resumable stream.
STREAM_ID_HEADER = "Streamwarden-Stream-Id"
#: Request headers whose values make the owner of a stream, besides
#: ``resume_owner_headers``: every credential header a dialect's clients send.
OWNER_HEADERS = CREDENTIAL_HEADERS
#: Query parameters whose values make the owner of a stream, besides
#: ``resume_owner_query_params``: credentials a client may put in the URL.
OWNER_QUERY_PARAMS = CREDENTIAL_QUERY_PARAMETERS

#: A stream id as :func:`new_stream_id` writes it. ASCII only, as the position:
#: ``str.isdigit`` and ``int`` also take other scripts' digits (``²``, ``٣``).
_STREAM_ID = re.compile(r"[0-9a-f]{32}", re.ASCII)
#: A position, ``<stream id>.<seq>``: at most 18 digits, so the sequence
#: number fits a Redis Stream entry id (and any int64) whatever a client sends.
_POSITION = re.compile(r"([0-9a-f]{32})\.([0-9]{1,18})", re.ASCII)
#: The longest value read as a position (a stream id, a dot, 18 digits).
MAX_POSITION_CHARS = 32 + 1 + 18
#: What is trimmed around an id: the ASCII blanks HTTP allows, never other scripts' spaces.
_BLANKS = " \t"


class ResumeResult(StrEnum):
    """How a resume was answered (the metric's label)."""

    OK = "ok"
    #: Unknown, expired or never resumable: ``resume_expired``.
    EXPIRED = "expired"
    #: The position asked for was already evicted: ``resume_gap``.
    GAP = "gap"
    #: Other credentials than the stream's: answered as ``EXPIRED``.
    DENIED = "denied"
    #: The store could not be asked: ``resume_unavailable``.
    UNAVAILABLE = "unavailable"


def new_stream_id() -> str:
    """128 random bits, as 32 lowercase hex digits: unguessable, safe in a header."""
    return secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class Position:
    """Where a client's copy of a stream ends: the last event it received."""

    stream_id: str
    seq: int


def parse_position(value: str) -> Position | None:
    """``<stream id>.<seq>`` as the sidecar wrote it, or ``None`` for anything else.

    Strict: ASCII hex and digits only, bounded, so that a hostile id is an
    unknown stream (``resume_expired``), never an error of ours.
    """
    value = value.strip(_BLANKS)
    if len(value) > MAX_POSITION_CHARS:
        return None
    matched = _POSITION.fullmatch(value)
    if matched is None:
        return None
    return Position(matched[1], int(matched[2]))


def parse_stream_id(value: str) -> str | None:
    """A stream id as :func:`new_stream_id` writes it (any case), or ``None``."""
    value = value.strip(_BLANKS)
    if not value.isascii():  # before lower(): letters of other scripts lower to ASCII (K to k)
        return None
    value = value.lower()
    return value if _STREAM_ID.fullmatch(value) else None


def resume_position(last_event_id: str | None, query_string: str) -> Position | str | None:
    """The position a request resumes from.

    ``None``: not a resume (no ``Last-Event-ID`` header, no
    ``last_event_id`` query parameter, or empty ones). A string: a resume
    whose position is not one the sidecar wrote (answered as an unknown
    stream, never forwarded).
    """
    asked = last_event_id
    if not asked and "last_event_id" in query_string:
        for name, value in parse_qsl(query_string, keep_blank_values=True):
            if name == "last_event_id":
                asked = value
                break
    if not asked or not asked.strip(_BLANKS):
        return None
    return parse_position(asked) or asked


@dataclass(frozen=True, slots=True)
class OwnerNames:
    """Where a request's credentials are: header names and query parameter names."""

    headers: frozenset[str]
    query_params: frozenset[str]

    @classmethod
    def of(cls, extra_headers: Iterable[str] = (), extra_params: Iterable[str] = ()) -> OwnerNames:
        """The built-in names and the configured ones (never fewer than the built-in)."""
        headers = {*OWNER_HEADERS, *(name.lower() for name in extra_headers)}
        params = {*OWNER_QUERY_PARAMS, *(name.lower() for name in extra_params)}
        return cls(frozenset(headers), frozenset(params))


#: The built-in names alone.
DEFAULT_OWNER_NAMES = OwnerNames.of()


def owner_digest(
    headers: Iterable[tuple[str, str]],
    stream_id: str,
    names: OwnerNames = DEFAULT_OWNER_NAMES,
    secret: str = "",
    query_string: str = "",
) -> str:
    """A keyed digest of the request's credentials, to compare a resume's with.

    The credentials are the values of the ``names`` headers and query
    parameters, however many and in whatever order (a name in any case).
    The stream id keys it, so the store holds nothing that could be compared
    with another stream's owner or looked up in a table of known keys. With
    ``resume_secret`` the secret keys it too: whoever reads the store can then
    not test guessed credentials against a digest, nor write one that passes.
    Neither the credentials nor the digest's input is kept or logged.
    """
    parts = credential_parts(headers, query_string, names.headers, names.query_params)
    message = b"\0".join(part.encode("utf-8", "surrogateescape") for part in parts)
    key = stream_id.encode() if not secret else secret.encode() + b"\0" + stream_id.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def same_owner(stored: str, presented: str) -> bool:
    return hmac.compare_digest(stored, presented)


# -- the memory store ------------------------------------------------------------


class StoredStream:
    """One stream's events in the memory store, and who is waiting for more."""

    __slots__ = (
        "_listeners",
        "_store",
        "bytes",
        "dialect",
        "ended",
        "ended_at",
        "events",
        "first_seq",
        "last_seq",
        "owner",
        "stream_id",
    )

    def __init__(self, store: MemoryStore, stream_id: str, owner: str, dialect: str) -> None:
        self._store = store
        self.stream_id = stream_id
        self.owner = owner
        self.dialect = dialect
        # Only the bytes: sequence numbers are contiguous from first_seq, and
        # bytes (unlike tuples) are not tracked by the garbage collector,
        # whose passes over millions of stored events would pause every stream.
        self.events: deque[bytes] = deque()
        self.bytes = 0
        #: The sequence number of the oldest event still held.
        self.first_seq = 1
        self.last_seq = 0
        #: The end state once the stream ended, else ``None``.
        self.ended: str | None = None
        self.ended_at: float | None = None
        self._listeners: list[Callable[[], None]] = []

    # JournalSink
    def append(self, seq: int, data: bytes) -> None:
        self.events.append(data)
        self.last_seq = seq
        size = len(data)
        self.bytes += size
        store = self._store
        store.total_bytes += size
        if self.bytes > store.max_stream_bytes or store.total_bytes > store.max_total_bytes:
            store._trim(self)
        if self._listeners:
            self._notify()

    def end(self, state: str, dialect: str) -> None:
        if self.ended is None:
            self.dialect = dialect
            self.ended = state
            self.ended_at = self._store.clock()
            self._store._note_end(self)
        self._notify()

    def after(self, seq: int) -> list[bytes] | None:
        """The events after ``seq``; ``None`` if some of them were already evicted."""
        if seq + 1 < self.first_seq:
            return None
        if seq >= self.last_seq:
            return []
        skip = seq + 1 - self.first_seq
        events = self.events
        return [events[i] for i in range(skip, len(events))]

    def listen(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    def unlisten(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def evict_front(self) -> None:
        data = self.events.popleft()
        self.first_seq += 1
        self.bytes -= len(data)
        self._store.total_bytes -= len(data)

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # a listener must not break the stream that writes
                continue


class MemoryStore:
    """A bounded in-process store of resumable streams.

    Bounds: ``max_stream_bytes`` per stream (its oldest events are evicted
    first: a resume from before them gets ``resume_gap``), ``max_total_bytes``
    for all (ended streams go first, oldest first, then the oldest events of
    the largest live stream), and ``ttl`` after a stream ended.
    """

    def __init__(
        self,
        *,
        max_stream_bytes: int,
        max_total_bytes: int,
        ttl: float,
        clock: Callable[[], float],
    ) -> None:
        self.max_stream_bytes = max_stream_bytes
        self.max_total_bytes = max_total_bytes
        self.ttl = ttl
        self.clock = clock
        self.total_bytes = 0
        self._streams: dict[str, StoredStream] = {}
        # Ended streams, oldest end first: what expires and is evicted first.
        self._ended: OrderedDict[str, StoredStream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, stream_id: str, owner: str, dialect: str) -> StoredStream:
        self.expire()
        stored = StoredStream(self, stream_id, owner, dialect)
        self._streams[stream_id] = stored
        return stored

    def find(self, stream_id: str) -> StoredStream | None:
        """The stream, or ``None`` if unknown or expired (the owner is the caller's check)."""
        self.expire()
        return self._streams.get(stream_id)

    def expire(self) -> None:
        if not self._ended:
            return
        now = self.clock()
        while self._ended:
            stored = next(iter(self._ended.values()))
            if stored.ended_at is None or now - stored.ended_at < self.ttl:
                break
            self._drop(stored)

    def _trim(self, stored: StoredStream) -> None:
        while stored.bytes > self.max_stream_bytes and len(stored.events) > 1:
            stored.evict_front()
        while self.total_bytes > self.max_total_bytes:
            if self._ended:
                self._drop(next(iter(self._ended.values())))
                continue
            largest = max(self._streams.values(), key=lambda s: s.bytes)
            if len(largest.events) <= 1:
                break
            largest.evict_front()

    def _note_end(self, stored: StoredStream) -> None:
        self._ended[stored.stream_id] = stored

    def _drop(self, stored: StoredStream) -> None:
        self._ended.pop(stored.stream_id, None)
        if self._streams.get(stored.stream_id) is stored:
            del self._streams[stored.stream_id]
        self.total_bytes -= stored.bytes
        stored.bytes = 0
        stored.events.clear()
