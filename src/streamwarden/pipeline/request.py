"""A request as the pipeline sees it, and what the pipeline decides for it.

Both faces describe each request the same way (:class:`IncomingRequest`:
method, path, raw target and query, headers, and a way to read its body's
first bytes and, bounded, the rest) and hand it to the pipeline's request
step (:class:`~streamwarden.pipeline.step.RequestStep`). It decides one of:

- :class:`Answer`: answer now with this status, headers and body (a
  refusal, an owner's stop), never forwarded;
- :class:`Serve`: answer now with a stream the pipeline writes through
  the face's :class:`AnswerWriter` (a resume, served from the store);
- :class:`Forward`: send the request on (to the upstream, to the app),
  with the body's first bytes read, a rewritten body if a stage rewrote
  it, the stream's part in usage injection, and the stream slot it holds.

Nothing here does I/O: reading the body is the face's (its
:class:`RequestBody`), and so is writing an answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from streamwarden.config import ResolvedRoute
from streamwarden.core.refusals import RefusalKind
from streamwarden.core.usage import UsageRole
from streamwarden.observation.register import NO_SLOT, Slot

if TYPE_CHECKING:
    from streamwarden.observation.telemetry import RequestTrace

__all__ = [
    "Answer",
    "AnswerWriter",
    "Decision",
    "Forward",
    "IncomingRequest",
    "RequestBody",
    "RequestRefused",
    "Rewrite",
    "Serve",
]


class RequestRefused(Exception):
    """A face's body reader cannot read the body (``Expect`` not understood, say)."""

    def __init__(self, kind: RefusalKind, **values: object) -> None:
        super().__init__(kind.refusal.code)
        self.kind = kind
        self.values = values


class RequestBody(Protocol):
    """A request's body as its face reads it (every read bounded by the caller)."""

    #: The face reads the body only when the pipeline needs it (the middleware:
    #: the app reads its own); else it reads the first bytes anyway.
    lazy: bool

    async def start(self) -> bytes:
        """The body's first bytes (read once; later calls give the same).

        Raises :class:`RequestRefused` when they cannot be read at all.
        """
        ...

    async def read_on(self, start: bytes, limit: int) -> tuple[bytes, bool]:
        """The body from ``start`` on, up to ``limit`` bytes: (bytes, whether whole)."""
        ...


@dataclass(slots=True, eq=False)
class IncomingRequest:
    """What a face knows of a request before anything is forwarded."""

    method: str
    #: The path without its query.
    path: str
    #: The request target as sent (path and query, not decoded).
    target: str
    #: The query string as sent (not decoded).
    query_string: str
    #: The headers, names in any case (look up with :meth:`header`).
    headers: Collection[tuple[str, str]]
    #: The route's settings for the path.
    route: ResolvedRoute
    #: The ``Host`` the client named (usage habits are per host).
    host: str = ""
    #: The declared body length, when there is one.
    content_length: int | None = None
    #: The body, or None for a request without one.
    body: RequestBody | None = None
    #: The request's OpenTelemetry spans, once opened (telemetry on).
    trace: RequestTrace | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (any case), or None."""
        lowered = name.lower()
        for key, value in self.headers:
            if key.lower() == lowered:
                return value
        return None


class AnswerWriter(Protocol):
    """A face's response to an answer the pipeline writes: start it, write to it, end it.

    ``write`` raises whatever the face raises for a client that left.
    """

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def finish(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer now, as a whole: never forwarded."""

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    @classmethod
    def refused(cls, kind: RefusalKind, **values: object) -> Answer:
        """A refusal a face gives itself (the table: :mod:`~streamwarden.core.refusals`)."""
        refusal = kind.refusal
        headers = (("Content-Type", "application/json"), *refusal.headers)
        return cls(refusal.status, headers, refusal.body(**values))


@dataclass(frozen=True, slots=True)
class Serve:
    """Answer now with a stream the pipeline writes (a resume): never forwarded."""

    #: Writes the whole answer through the face's writer; the stream slot it
    #: holds is given back when it returns or raises.
    run: Callable[[AnswerWriter], Awaitable[object]]
    #: A client that takes no bytes for this long is cut (client_write_timeout; 0: never).
    write_timeout: float
    #: The stream it serves runs in this process and holds its own slot: the
    #: answer takes none (one generation, one slot, however often resumed).
    slot_held: bool = False


@dataclass(frozen=True, slots=True)
class Rewrite:
    """A body a stage rewrote, and the client's own, sent instead if the upstream refuses it."""

    body: bytes
    original: bytes
    #: Whether an upstream's answer (status, the first bytes of its body)
    #: refuses what the rewrite added: then the client's own body goes, once.
    refuses: Callable[[int, bytes], bool]


@dataclass(slots=True, eq=False)
class Forward:
    """Send the request on; what the pipeline made of it on the way."""

    #: The request asks for a stream (as far as its body's first bytes say).
    asks_for_stream: bool
    #: The body's first bytes, as read (``b""``: none read).
    body_start: bytes = b""
    #: The body to send instead of the client's (usage injection), or None.
    rewritten: Rewrite | None = None
    #: The stream's part in usage injection (take back, or watch a habit).
    usage: UsageRole = None
    #: The ``max_concurrent_streams`` slot it holds (a stream asked for).
    slot: Slot = field(default=NO_SLOT)


#: What the request step decides.
Decision = Answer | Serve | Forward
