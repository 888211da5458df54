"""What the requests of one middleware instance share: its settings and its register of streams.

The register counts the streams in flight (the ``streamwarden_active_streams``
gauge) and the requests holding a ``max_concurrent_streams`` slot, keeps the
recently finished streams' records (tests and ``streams`` readers use them),
and hands each record to its listeners (metrics, the stream log line)
exactly once, when the stream ends.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from streamwarden.config import Settings
from streamwarden.meter import GapObserver, StreamRecord

__all__ = ["FaceContext", "Listener", "Streams"]

log = logging.getLogger("streamwarden.middleware")

Listener = Callable[[StreamRecord], None]


class Streams:
    """The middleware's register of streams: how many are in flight, the recently finished."""

    def __init__(self, keep: int = 1000) -> None:
        self.active = 0
        #: Requests holding a max_concurrent_streams slot: they asked for a
        #: stream, and it (or their response) is not over yet.
        self.admitted = 0
        self.finished: deque[StreamRecord] = deque(maxlen=keep)
        #: Called with each finished stream's record, exactly once per stream.
        self.listeners: list[Listener] = []
        self._ids = itertools.count(1)

    def open(self) -> str:
        self.active += 1
        return f"{next(self._ids):x}"

    def close(self, record: StreamRecord) -> None:
        self.active -= 1
        self.finished.append(record)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("a stream listener failed")


@dataclass(frozen=True, slots=True)
class FaceContext:
    """What every request of one middleware instance shares."""

    settings: Settings
    streams: Streams
    gap_observer: GapObserver | None = None
    #: ``settings.stream_media_types``, lower-cased, for the stream check.
    extra_media_types: frozenset[str] = field(default=frozenset())
