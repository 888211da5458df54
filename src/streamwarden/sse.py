"""Incremental server-sent events decoding and event framing, with no I/O.

This module turns the bytes of an event stream into events, following the
WHATWG HTML "Server-sent events" parsing rules byte for byte, and does so
identically for any chunking of the input. It has two consumers:

- :class:`SSEDecoder`, the public decoder (``feed``/``close`` return
  :class:`Event` objects), and
- :class:`SSEFramer` / :class:`LineFramer`, used by the relay: each complete
  block (SSE) or line (NDJSON, Vercel AI data stream) comes out as a
  :class:`Frame` holding the upstream's raw bytes, unmodified, together with
  the decoded event, so that a proxy forwards exactly what it received and
  holds back a partial event until its last byte arrives.

The parser works on bytes rather than on decoded text: line terminators are
ASCII and can never occur inside a multi-byte UTF-8 sequence, so splitting
lines on bytes and decoding each field value on its own (invalid sequences
become U+FFFD) gives the same result as decoding the whole stream first,
while keeping the raw bytes of every block at hand.

Intentional divergences, each for the relay's sake:

- A leading UTF-8 byte order mark is stripped from the raw bytes too, not
  only from the decoded text. A proxy may write a keep-alive comment before
  the upstream's first byte; a BOM forwarded after it would no longer be at
  the start of the stream and would turn the first field name into
  ``"\\ufeffdata"``, losing the event. A BOM followed by a second one is
  kept: stripped, it would put the second one at the head of the forwarded
  bytes, where a client would strip it and read the first line as a real
  field, although the upstream's own reader ignores it.
- A CR that ends one chunk and an LF that starts the next are one line
  ending (as the spec requires). When that CR ends a block, the block is
  dispatched at the CR, without waiting for the next read, and the LF
  becomes a frame of its own (raw ``b"\\n"``, no event) as soon as it
  arrives: both bytes are forwarded, in order, nothing is held back at a
  clean end, and no block's frame starts with a stray LF. (Dropping the LF
  instead would break clients that split lines on LF alone, as
  google-genai's aiohttp reader does.)
- Memory is bounded: a block (or line) whose raw size exceeds
  ``max_event_bytes`` raises :class:`EventTooLarge` instead of growing.
- A ``retry`` value of more digits than Python converts to an integer
  (4,300 by default, leading zeros aside) is ignored rather than raising.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Event",
    "EventTooLarge",
    "Frame",
    "LineFramer",
    "SSEDecoder",
    "SSEFramer",
]

_BOM = b"\xef\xbb\xbf"
_LF = 0x0A
_CR = 0x0D
_SPACE = 0x20


@dataclass(frozen=True, slots=True)
class Event:
    """One dispatched event.

    ``id`` is the stream's last-event-id buffer at dispatch time: ``None``
    if no ``id`` field was ever accepted, ``""`` after an explicit empty
    ``id``. It persists across events, as in a browser's ``EventSource``.
    """

    event: str = "message"
    data: str = ""
    id: str | None = None


@dataclass(frozen=True, slots=True)
class Frame:
    """The raw bytes of one complete block or line, and what it decoded to.

    ``event`` is ``None`` for blocks that dispatch nothing: comments
    (keep-alives, pings), blocks with no ``data`` field, stray blank lines.
    """

    raw: bytes
    event: Event | None


class EventTooLarge(ValueError):
    """A block or line grew past ``max_event_bytes``.

    ``frames`` holds the complete frames that preceded the oversized one in
    the same ``feed`` call; they are whole and safe to forward. The framer
    is unusable afterwards: the stream has to end.
    """

    def __init__(self, size: int, limit: int, frames: list[Frame]) -> None:
        super().__init__(f"event of at least {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit
        self.frames = frames


#: The LF of a CRLF whose CR ended the previous frame (see the divergences).
_SPLIT_LF = Frame(b"\n", None)


class SSEFramer:
    """Splits an event stream into frames, keeping each block's raw bytes.

    ``feed`` returns the frames completed by a chunk; bytes of a block whose
    terminating blank line has not arrived are held back. ``close`` ends the
    stream: per the spec, an unterminated final block is discarded, never
    dispatched.
    """

    __slots__ = (
        "_bom_stripped",
        "_buf",
        "_data",
        "_event_type",
        "_failed",
        "_last_id",
        "_limit",
        "_pos",
        "_skip_lf",
        "_stream_start",
        "retry",
    )

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._limit = max_event_bytes
        # Raw bytes of the current, incomplete block; _pos is where its
        # current, incomplete line starts (earlier lines are already parsed).
        self._buf = bytearray()
        self._pos = 0
        self._skip_lf = False
        self._stream_start = True
        self._bom_stripped = False
        self._failed = False
        self._data: list[str] = []
        self._event_type = ""
        self._last_id: str | None = None
        #: The reconnection time, in milliseconds, last set by a valid
        #: ``retry`` field, or ``None``.
        self.retry: int | None = None

    @property
    def pending_bytes(self) -> int:
        """How many bytes of an incomplete block are held back."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Frame]:
        """Consume ``chunk`` and return the frames it completed."""
        if self._failed:
            raise EventTooLarge(len(self._buf), self._limit or 0, [])
        buf = self._buf
        buf += chunk
        if self._stream_start:
            # The BOM may itself arrive split across chunks: wait for three
            # bytes (or a mismatch) before deciding. Once one is stripped,
            # decide the same way whether a second one follows; if so, both
            # are kept (see the divergences above).
            if len(buf) < 3 and _BOM.startswith(buf):
                return []
            if not self._bom_stripped and buf.startswith(_BOM):
                del buf[:3]
                self._bom_stripped = True
                if len(buf) < 3 and _BOM.startswith(buf):
                    return []
            self._stream_start = False
            if self._bom_stripped and buf.startswith(_BOM):
                buf[:0] = _BOM
        pos = self._pos
        n = len(buf)
        frames: list[Frame] = []
        block_start = 0
        if self._skip_lf and pos < n:
            self._skip_lf = False
            if buf[pos] == _LF:
                pos += 1
                if pos == 1:
                    # The CR ended a block, which left at once; its LF is
                    # all that is held, and it is not the start of the next
                    # block: forwarded now, it leaves nothing held at a
                    # clean end.
                    frames.append(_SPLIT_LF)
                    block_start = 1
        limit = self._limit
        lf = buf.find(b"\n", pos)
        cr = buf.find(b"\r", pos)
        while True:
            if lf != -1 and lf < pos:
                lf = buf.find(b"\n", pos)
            if cr != -1 and cr < pos:
                cr = buf.find(b"\r", pos)
            if cr == -1:
                if lf == -1:
                    break
                eol = lf
                nxt = lf + 1
            elif lf == -1 or cr < lf:
                eol = cr
                if cr + 1 < n:
                    nxt = cr + 2 if buf[cr + 1] == _LF else cr + 1
                else:
                    nxt = cr + 1
                    self._skip_lf = True
            else:
                eol = lf
                nxt = lf + 1
            if eol == pos:
                # A blank line ends the block.
                if limit is not None and nxt - block_start > limit:
                    self._fail(nxt - block_start, frames)
                frames.append(Frame(bytes(buf[block_start:nxt]), self._dispatch()))
                block_start = nxt
            elif buf[pos] != 0x3A:  # lines starting with ":" are comments
                self._field(buf, pos, eol)
            pos = nxt
        if block_start:
            del buf[:block_start]
            pos -= block_start
        self._pos = pos
        if limit is not None and len(buf) > limit:
            self._fail(len(buf), frames)
        return frames

    def close(self) -> list[Frame]:
        """End of stream. An unterminated final block is dropped, not dispatched."""
        self._buf.clear()
        self._pos = 0
        self._data.clear()
        self._event_type = ""
        return []

    def _fail(self, size: int, frames: list[Frame]) -> None:
        self._failed = True
        self._buf.clear()
        self._pos = 0
        raise EventTooLarge(size, self._limit or 0, frames)

    def _field(self, buf: bytearray, start: int, end: int) -> None:
        colon = buf.find(b":", start, end)
        if colon == -1:
            name = bytes(buf[start:end])
            value_start = end
        else:
            name = bytes(buf[start:colon])
            value_start = colon + 1
            if value_start < end and buf[value_start] == _SPACE:
                value_start += 1
        if name == b"data":
            self._data.append(buf[value_start:end].decode("utf-8", "replace"))
        elif name == b"event":
            self._event_type = buf[value_start:end].decode("utf-8", "replace")
        elif name == b"id":
            value = buf[value_start:end].decode("utf-8", "replace")
            if "\x00" not in value:
                self._last_id = value
        elif name == b"retry":
            digits = bytes(buf[value_start:end])
            if digits and digits.isdigit():  # bytes.isdigit is ASCII-only
                retry = _retry_value(digits)
                if retry is not None:
                    self.retry = retry
        # Any other field name is ignored, as the spec requires.

    def _dispatch(self) -> Event | None:
        data = self._data
        event_type = self._event_type
        self._event_type = ""
        if not data:
            return None
        text = data[0] if len(data) == 1 else "\n".join(data)
        data.clear()
        return Event(event_type or "message", text, self._last_id)


def _retry_value(digits: bytes) -> int | None:
    """The value of a ``retry`` field made only of ASCII digits.

    Python converts at most ``sys.get_int_max_str_digits()`` digits (4,300
    by default) and raises ``ValueError`` beyond: from an upstream's bytes,
    that would break the stream. Such a value (leading zeros aside) means
    nothing as milliseconds and is ignored, keeping the previous one, as a
    browser ignores a value that overflows its integer.
    """
    try:
        return int(digits.lstrip(b"0") or b"0")
    except ValueError:
        return None


class SSEDecoder:
    """Incremental WHATWG server-sent events decoder.

    ``SSEDecoder().feed(chunk)`` returns the events completed by ``chunk``;
    ``close()`` ends the stream (an unterminated final event is not
    dispatched). ``retry`` holds the reconnection time last set by a valid
    ``retry`` field, also from a block that dispatched no event.
    """

    __slots__ = ("_framer",)

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._framer = SSEFramer(max_event_bytes)

    @property
    def retry(self) -> int | None:
        return self._framer.retry

    def feed(self, chunk: bytes) -> list[Event]:
        return [f.event for f in self._framer.feed(chunk) if f.event is not None]

    def close(self) -> list[Event]:
        return [f.event for f in self._framer.close() if f.event is not None]


class LineFramer:
    """Splits a line-delimited stream (NDJSON, Vercel AI data stream) into frames.

    Lines end with LF (a CR before it is kept in the raw bytes and dropped
    from the decoded text). Each non-empty line becomes a frame whose event
    carries the line as ``data``; blank lines are frames without an event.
    As with SSE, a final line without its terminator is never dispatched.
    """

    __slots__ = ("_buf", "_failed", "_limit")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._limit = max_event_bytes
        self._buf = bytearray()
        self._failed = False

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[Frame]:
        if self._failed:
            raise EventTooLarge(len(self._buf), self._limit or 0, [])
        buf = self._buf
        buf += chunk
        frames: list[Frame] = []
        limit = self._limit
        start = 0
        while (lf := buf.find(b"\n", start)) != -1:
            end = lf + 1
            if limit is not None and end - start > limit:
                self._fail(end - start, frames)
            frames.append(_line_frame(bytes(buf[start:end])))
            start = end
        if start:
            del buf[:start]
        if limit is not None and len(buf) > limit:
            self._fail(len(buf), frames)
        return frames

    def close(self) -> list[Frame]:
        """End of stream. A final line without its LF is dropped, not dispatched.

        NDJSON requires every record to end with a newline, and the Vercel
        data stream writes one after every part: a line cut short is a
        truncated record, and forwarding it would hand the client broken JSON.
        """
        self._buf.clear()
        return []

    def _fail(self, size: int, frames: list[Frame]) -> None:
        self._failed = True
        self._buf.clear()
        raise EventTooLarge(size, self._limit or 0, frames)


def _line_frame(raw: bytes) -> Frame:
    # Only the line's own ending goes: its LF and one CR before it. A CR
    # further back is part of the line.
    text = raw.removesuffix(b"\n").removesuffix(b"\r")
    if not text.strip():
        return Frame(raw, None)
    return Frame(raw, Event("message", text.decode("utf-8", "replace"), None))
