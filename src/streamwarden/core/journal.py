"""A resumable stream's journal, with no I/O: event ids stamped in, each event written out.

The relay's side of resumable streams (:mod:`streamwarden.features.resume.model` is the
rest: positions, owners, the stores). On a route with ``on_client_gone:
detach`` the relay hands every event it forwards to the stream's
:class:`Journal`, which gives it an ``id: <stream id>.<seq>`` field (the
sequence counts the stream's events from 1) and writes it to a
:class:`JournalSink`, one stream's entry in whatever store the face opened.
The relay needs nothing else of the feature, so this is all of it the core
imports.

On such a route the sidecar owns the ``id`` field: an upstream's own ``id``
lines are removed from each event (they would otherwise reset the client's
last event id to something the store does not know), and ours is the
event's last field. Everything else in the block is forwarded as received.
A block that dispatches no event loses its ``id`` lines too
(:func:`strip_ids`): they would still set the client's last event id.
"""

from __future__ import annotations

import re
from typing import Protocol

__all__ = ["Journal", "JournalSink", "stamp", "strip_ids"]

# An ``id`` field line (the bare name or name and colon), at a line start.
_ID_LINE = re.compile(rb"(?:(?<=[\r\n])|\A)id(?::[^\r\n]*)?(?:\r\n|\r|\n)")


def _without_ids(raw: bytes) -> bytes:
    # Most blocks have no id line, while nearly every JSON payload has an
    # "id" key: three substring scans (well under a microsecond) spare the
    # regex (several) on the path of every event.
    if raw.startswith(b"id") or b"\nid" in raw or b"\rid" in raw:
        return _ID_LINE.sub(b"", raw)
    return raw


def stamp(raw: bytes, event_id: bytes) -> bytes:
    """One event block with the upstream's ``id`` lines removed and ``id: event_id`` last."""
    return b"%bid: %b\n\n" % (_fields(raw), event_id)


def _split_end(raw: bytes) -> tuple[bytes, bytes]:
    """A block's field lines, and the line end of the empty line that ended it."""
    if raw.endswith(b"\r\n"):
        return raw[:-2], b"\r\n"
    if raw.endswith((b"\n", b"\r")):
        return raw[:-1], raw[-1:]
    return raw, b""


def _fields(raw: bytes) -> bytes:
    """A block's field lines, without the empty line that ended it (nor id lines).

    The empty line's end goes first: removing an id line before it could
    join the CR ending the line above with that LF into one CRLF, and so
    fold the block's end into its last field line.
    """
    return _without_ids(_split_end(raw)[0])


def strip_ids(raw: bytes) -> bytes:
    """A block that dispatches no event, without ``id`` lines (which would still set one)."""
    body, end = _split_end(raw)
    return _without_ids(body) + end


class JournalSink(Protocol):
    """Where a journal writes: one stream's entry in a store."""

    def append(self, seq: int, data: bytes) -> None: ...

    def end(self, state: str, dialect: str) -> None: ...


class Journal:
    """Numbers a resumable stream's events and writes each one to its store."""

    __slots__ = ("_id_field", "_sink", "seq", "stream_id")

    def __init__(self, stream_id: str, sink: JournalSink) -> None:
        self.stream_id = stream_id
        self._sink = sink
        self._id_field = b"id: " + stream_id.encode() + b"."
        #: The last event's sequence number (0: none yet).
        self.seq = 0

    def record(self, raw: bytes) -> bytes:
        """Stamp one event block with the next id, store it, and return it."""
        seq = self.seq = self.seq + 1
        out = b"%b%b%d\n\n" % (_fields(raw), self._id_field, seq)
        self._sink.append(seq, out)
        return out

    def end(self, state: str, dialect: str) -> None:
        """The stream ended (``state``); ``dialect`` is what it turned out to be."""
        self._sink.end(state, dialect)
