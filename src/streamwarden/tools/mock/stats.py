"""What the mock did for each request: the ground truth tests meter against.

One :class:`RequestRecord` per request (the ``/_mock/*`` endpoints excepted),
kept in memory by :class:`MockStats` and served as JSON at
``GET /_mock/stats``. A record counts a token as generated only once its
bytes were handed to the transport without error, so after a client leaves
the count is exactly what the mock managed to send. Times are
``time.monotonic()`` readings of the mock's process, so a test running the
mock in-process can compare them with its own clock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MockStats", "RequestRecord"]


@dataclass(slots=True, eq=False)
class RequestRecord:
    """The mock's account of one request, updated while the request runs."""

    request_id: str
    """The id from the ``request-id`` control, else generated; also in ``x-mock-request-id``."""
    path: str
    """The request path (without the query)."""
    dialect: str | None
    """The streamwarden dialect of the answer (``None`` for echo and WebSocket)."""
    wire: str
    """The mock's wire format name (``openai-chat``, ..., ``echo``, ``websocket``)."""
    fault: str | None
    """The fault applied, by name."""
    streamed: bool
    """Whether the answer was (to be) streamed."""
    started_at: float
    """When the mock started handling the request (monotonic seconds)."""
    tokens_planned: int = 0
    """Tokens the answer would have had without faults."""
    tokens_generated: int = 0
    """Tokens whose bytes were handed to the transport successfully."""
    completed: bool = False
    """The answer was delivered whole: the terminal event (or the last event,
    for formats without one, or the whole reply body) was written."""
    closed_early: bool = False
    """The client went away before the mock was done."""
    closed_at: float | None = None
    """When the mock noticed the client had gone (monotonic seconds)."""
    ended_at: float | None = None
    """When the mock finished handling the request (monotonic seconds)."""
    status: int | None = None
    """The HTTP status sent, once the response started."""
    close_code: int | None = None
    """WebSocket only: the close code of the connection."""
    traceparent: str | None = None
    """The W3C ``traceparent`` the request carried, if any."""
    engine: Any = field(default=None, repr=False, compare=False)
    """The simulated engine whose counters this request's tokens count in."""

    @property
    def ended(self) -> bool:
        """Whether the mock is done with the request."""
        return self.ended_at is not None

    def note_client_gone(self, now: float) -> None:
        """Record that the client went away (the first notice counts)."""
        if not self.closed_early:
            self.closed_early = True
            self.closed_at = now

    def to_dict(self) -> dict[str, object]:
        """The record as JSON-compatible data."""
        data = asdict(self)
        data.pop("engine", None)
        return data


class MockStats:
    """All request records of one mock server, oldest first."""

    def __init__(self) -> None:
        self._records: list[RequestRecord] = []

    def open(
        self,
        request_id: str,
        path: str,
        *,
        dialect: str | None,
        wire: str,
        fault: str | None,
        streamed: bool,
        tokens_planned: int = 0,
    ) -> RequestRecord:
        """Start and keep a record for a request."""
        record = RequestRecord(
            request_id=request_id,
            path=path,
            dialect=dialect,
            wire=wire,
            fault=fault,
            streamed=streamed,
            started_at=time.monotonic(),
            tokens_planned=tokens_planned,
        )
        self._records.append(record)
        return record

    @property
    def records(self) -> tuple[RequestRecord, ...]:
        """Every record, oldest first (live objects: they change while requests run)."""
        return tuple(self._records)

    def get(self, request_id: str) -> RequestRecord | None:
        """The latest record with ``request_id``, or ``None``."""
        for record in reversed(self._records):
            if record.request_id == request_id:
                return record
        return None

    def reset(self) -> None:
        """Forget every record (requests still running keep updating theirs)."""
        self._records.clear()

    def to_dict(self) -> dict[str, object]:
        """All records as JSON-compatible data: ``{"records": [...]}``."""
        return {"records": [record.to_dict() for record in self._records]}

    async def wait_ended(self, request_id: str, timeout: float = 5.0) -> RequestRecord:
        """Wait until the request ``request_id`` is recorded and ended, and return it.

        Raises ``TimeoutError`` when that takes longer than ``timeout`` seconds.
        A mock notices a client leaving a few milliseconds after the fact, so
        tests wait for the record instead of sleeping a guessed amount.
        """
        async with asyncio.timeout(timeout):
            while True:
                record = self.get(request_id)
                if record is not None and record.ended:
                    return record
                await asyncio.sleep(0.002)
