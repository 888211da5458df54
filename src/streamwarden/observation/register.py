"""The register of streams each face keeps, and its ``max_concurrent_streams`` slots.

One implementation for both faces (the sidecar's tracker and the
middleware's ``streams`` are this class), so that the rules are the same:

- every stream is recorded exactly once, when it ends, and each listener
  (metrics, the stream log line) sees each record once; a listener that
  raises is logged and the others still run, and the register still
  empties (a broken listener must not stall a drain that waits for it);
- a request that asks for a stream takes a :class:`Slot` before the
  upstream (or the app) is asked, or is refused; the slot goes back once,
  whichever way the exchange ends, and as early as the face knows the
  stream is over (a client may ask again the moment it has the end). A
  stream that runs on after its client left (``on_client_gone: drain`` or
  ``detach``) is not over: it keeps its slot until it ends, so that the
  limit bounds the generations running upstream whatever clients do;
- a finished stream's record is built by :func:`finished_record`, from the
  relay, in one place; both faces end their streams through
  :class:`~streamwarden.pipeline.end.StreamEnd`, which builds it and closes the
  stream here.

No I/O and no event loop: the sidecar adds its own wait for the register
to empty (the drain) through :attr:`StreamRegister.on_idle`.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from streamwarden.core.meter import StreamRecord
from streamwarden.core.relay import Relay

__all__ = ["NO_SLOT", "Listener", "Slot", "StreamRegister", "finished_record"]

log = logging.getLogger("streamwarden")

S = TypeVar("S")
Listener = Callable[[StreamRecord], None]


class Slot:
    """One held ``max_concurrent_streams`` place; ``release`` gives it back, once."""

    __slots__ = ("_give_back",)

    def __init__(self, give_back: Callable[[], None] | None) -> None:
        self._give_back = give_back

    def release(self) -> None:
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def pass_on(self) -> Slot:
        """The place, held on by a new holder; this one gives nothing back any more.

        For a stream that outlives the request that took its slot (read on
        after its client left): the request's own release, on its way out,
        must not free a place the stream still fills.
        """
        give_back, self._give_back = self._give_back, None
        return Slot(give_back)


#: The slot of a request under no limit: nothing to give back.
NO_SLOT = Slot(None)


class StreamRegister(Generic[S]):
    """Streams in flight, the last ``keep`` finished, and the slots held."""

    def __init__(self, keep: int = 1000) -> None:
        self.active: set[S] = set()
        self.finished: deque[StreamRecord] = deque(maxlen=keep)
        #: Called with each finished stream's record, exactly once per stream.
        self.listeners: list[Listener] = []
        #: Called each time the last stream in flight ends.
        self.on_idle: list[Callable[[], None]] = []
        #: Requests holding a slot: they asked for a stream, and it is not over.
        self.admitted = 0
        self._ids = itertools.count(1)

    def next_id(self) -> str:
        return f"{next(self._ids):x}"

    def admit(self, limit: int) -> Slot | None:
        """A slot for a request that asks for a stream, or ``None`` if ``limit`` are held."""
        if not limit:
            return NO_SLOT
        if self.admitted >= limit:
            return None
        self.admitted += 1
        return Slot(self._give_back)

    def _give_back(self) -> None:
        self.admitted -= 1

    def open(self, stream: S) -> None:
        self.active.add(stream)

    def close(self, stream: S, record: StreamRecord) -> None:
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
                for callback in self.on_idle:
                    callback()


def finished_record(
    stream_id: str, route: str, method: str, path: str, status: int, relay: Relay
) -> StreamRecord:
    """The record of a finished stream, as both faces publish it."""
    return StreamRecord(stream_id, route, method, path, status, relay.dialect, relay.meter)
