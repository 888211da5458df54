"""The faults the mock can inject, and where in a stream each one strikes.

Faults are named (``x-mock-fault: truncate`` or ``?fault=truncate``) and act
on the frame list a wire format rendered, so each one behaves the same way in
every dialect. This module decides *where* (:func:`cut_index`) and *what*
extra bytes a fault writes (:func:`giant_frame`, :func:`garbage_chunk`);
the server decides *how* to act on the socket. Nothing here does I/O.

In tool-call mode (``tool-call``) the token frames carry the call's argument
fragments, so ``truncate``, ``truncate-mid``, ``stall``, ``reset`` and
``broken-chunked`` strike inside the call's arguments (a Gemini call that
arrives whole is one frame: ``truncate-mid`` cuts inside it).

Where a stream-cutting fault strikes: before the token frame that would
carry token number ``after`` (0-based; the default is half the answer), or,
when ``after`` reaches the end of the answer, before the first usage or
terminal frame. So a cut never delivers the usage or the terminal event, and
an ``after`` of 0 cuts right after the preamble.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence

from streamwarden.tools.mock.formats import Answer, Frame, FrameRole, WireFormat

__all__ = ["Fault", "cut_index", "garbage_chunk", "giant_frame"]


class Fault(enum.StrEnum):
    """A misbehaviour of the simulated upstream, by its control name."""

    TRUNCATE = "truncate"
    """End the response cleanly at an event boundary, before usage and terminal."""
    TRUNCATE_MID = "truncate-mid"
    """End the response cleanly in the middle of an event."""
    STALL = "stall"
    """Go silent at the cut and keep the connection open until the client leaves
    (or, with ``delay``, resume the stream after that many seconds)."""
    STALL_BEFORE_HEADERS = "stall-before-headers"
    """Wait ``delay`` seconds (default 30) before sending the response headers."""
    SLOW_HEADERS = "slow-headers"
    """Same as ``stall-before-headers``; the name reads better for short delays."""
    RESET = "reset"
    """Abort the TCP connection (RST) at the cut: no chunked terminator.
    On a non-streamed request, abort instead of answering."""
    BROKEN_CHUNKED = "broken-chunked"
    """Write a malformed chunk-size line at the cut, then close the connection."""
    GIANT_EVENT = "giant-event"
    """Make the token event at the cut ``size`` bytes long (default 10 MiB)."""
    GARBAGE = "garbage"
    """Send random bytes (invalid UTF-8, no line breaks) instead of events."""
    ERROR_STATUS = "error-status"
    """Answer ``status`` (default 500) with the provider's error body, or empty."""
    KEEPALIVE_PINGS = "keepalive-pings"
    """Write an SSE comment ``: ping`` in the middle of every wait for a token."""
    BROKEN_TOOL_CALL = "broken-tool-call"
    """With ``tool-call``: send only the first ``fault-after`` fragments of the call's
    arguments (half by default, at least one), then close the call and end the
    stream as usual: the arguments the client holds are a prefix, not JSON
    (where the format repeats them whole, it repeats that prefix)."""

    @property
    def cuts_stream(self) -> bool:
        """Whether the fault acts at the cut point of a stream."""
        return self in _CUTTING

    @property
    def delays_headers(self) -> bool:
        """Whether the fault holds the response headers back for ``delay``."""
        return self in (Fault.STALL_BEFORE_HEADERS, Fault.SLOW_HEADERS)

    @property
    def applies_to_whole_replies(self) -> bool:
        """Whether the fault also makes sense for a non-streamed reply."""
        return self in _WHOLE_REPLY

    @property
    def needs_sse(self) -> bool:
        """Whether the fault only makes sense on a server-sent events stream."""
        return self is Fault.KEEPALIVE_PINGS


_CUTTING = frozenset(
    {Fault.TRUNCATE, Fault.TRUNCATE_MID, Fault.STALL, Fault.RESET, Fault.BROKEN_CHUNKED}
)
_WHOLE_REPLY = frozenset(
    {Fault.ERROR_STATUS, Fault.STALL_BEFORE_HEADERS, Fault.SLOW_HEADERS, Fault.RESET}
)

DEFAULT_GIANT_EVENT_BYTES = 10 * 1024 * 1024
"""The size of ``giant-event``'s event when the request names none."""

DEFAULT_HEADER_DELAY = 30.0
"""Seconds ``stall-before-headers`` / ``slow-headers`` wait when the request names none."""


def cut_index(frames: Sequence[Frame], after: int) -> int:
    """Return the index of the first frame a cutting fault keeps back.

    The fault strikes after ``after`` tokens were written, or before the
    first usage or terminal frame, whichever comes first (see the module
    docstring). The result is ``len(frames)`` when neither happens, which
    for a format with no terminal event means "after the last event".
    """
    written = 0
    for index, frame in enumerate(frames):
        if frame.role in (FrameRole.USAGE, FrameRole.TERMINAL):
            return index
        if frame.tokens:
            if written >= after:
                return index
            written += frame.tokens
    return len(frames)


_FILLER = "giant event padding "


def giant_frame(fmt: WireFormat, answer: Answer, index: int, size: int) -> Frame:
    """Render token ``index`` with ASCII padding so the frame is ``size`` bytes.

    The padding has no line breaks and needs no escaping in any format, so
    the event is one unbroken line until its final terminator. A ``size``
    below the frame's own framing yields the smallest frame possible.
    """
    base = len(fmt.token(answer, index, "").data)
    padding = max(size - base, 0)
    text = (_FILLER * (padding // len(_FILLER) + 1))[:padding]
    return fmt.token(answer, index, text)


# Bytes that no UTF-8 decoder accepts, so every garbage body is invalid text.
_INVALID_UTF8 = b"\xff\xfe\xc3\x28\xa0\xa1\xe2\x28\xa1\xf0\x28\x8c\xbc"
_LINE_BREAKS = frozenset(b"\r\n")


def garbage_chunk(rng: random.Random, size: int) -> bytes:
    """Return ``size`` random bytes with invalid UTF-8 and no CR or LF.

    Without line breaks no SSE or line decoder ever completes an event, so
    the garbage can only be noticed as garbage (or as a stream with no end).
    """
    raw = bytearray(_INVALID_UTF8[: min(size, len(_INVALID_UTF8))])
    while len(raw) < size:
        byte = rng.randrange(256)
        if byte not in _LINE_BREAKS:
            raw.append(byte)
    return bytes(raw)
