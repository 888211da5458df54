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
lines on bytes and decoding field values at dispatch (invalid sequences
become U+FFFD) gives the same result as decoding the whole stream first,
while keeping the raw bytes of every block at hand. Until its blank line
arrives, a block is only those raw bytes and a few offsets into them, so a
stream holds at most ``max_event_bytes`` plus a constant, whatever its
lines look like.

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

import contextlib
import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "Event",
    "EventTooLarge",
    "Frame",
    "LineFramer",
    "SSEDecoder",
    "SSEFramer",
    "with_data",
]

# Final: the compiled build inlines them (a plain module constant is a
# dictionary lookup at every use, in loops that run per byte of a line).
_BOM: Final = b"\xef\xbb\xbf"
_LF: Final = 0x0A
_CR: Final = 0x0D
_SPACE: Final = 0x20


# The two classes built once per event write their own __init__: a
# dataclass's generated one runs as interpreted Python even in the compiled
# build (a frozen one also sets each field through object.__setattr__), and
# cost more than the rest of framing an event. The dataclass still writes
# their equality, hash and repr. Neither is changed once built.
@dataclass(init=False, slots=True, unsafe_hash=True)
class Event:
    """One dispatched event.

    ``id`` is the stream's last-event-id buffer at dispatch time: ``None``
    if no ``id`` field was ever accepted, ``""`` after an explicit empty
    ``id``. It persists across events, as in a browser's ``EventSource``.
    """

    event: str
    data: str
    id: str | None

    def __init__(self, event: str = "message", data: str = "", id: str | None = None) -> None:
        self.event = event
        self.data = data
        self.id = id


@dataclass(init=False, slots=True)
class Frame:
    """The raw bytes of one complete block or line, and what it decoded to.

    ``event`` is ``None`` for blocks that dispatch nothing: comments
    (keep-alives, pings), blocks with no ``data`` field, stray blank lines.
    """

    raw: bytes
    event: Event | None

    def __init__(self, raw: bytes, event: Event | None) -> None:
        self.raw = raw
        self.event = event


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

    An incomplete block is held only as its raw bytes, plus a few integers:
    where its first ``data`` values (up to 16), its last ``event`` value and
    its last ``id`` value lie in those bytes, and how many ``data`` lines it
    has. Nothing is decoded per line, so what a stream holds is its raw
    pending bytes (at most ``max_event_bytes``) plus a constant, whatever
    the shape of its lines: one decoded string per line cost 6 to 14 times
    the raw size for floods of short lines. Values are decoded at dispatch;
    an event with more data lines than are tracked rescans its block once.
    """

    __slots__ = (
        "_bom_stripped",
        "_buf",
        "_data_end",
        "_data_lines",
        "_data_start",
        "_event_end",
        "_event_start",
        "_failed",
        "_id_end",
        "_id_start",
        "_last_id",
        "_limit",
        "_more_data",
        "_pos",
        "_scanned",
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
        # How far the buffer is known to hold no CR or LF after _pos: a line
        # that arrives over many reads is searched once, not once per read.
        self._scanned = 0
        self._skip_lf = False
        self._stream_start = True
        self._bom_stripped = False
        self._failed = False
        # The current block's fields, as offsets into _buf (-1: none yet).
        self._data_lines = 0
        self._data_start = 0
        self._data_end = 0
        # Where the values of the next few data lines lie, as start, end,
        # start, end...: bounded, so memory stays constant; an event with
        # more data lines than that rescans its block at dispatch instead.
        self._more_data: list[int] = []
        self._event_start = -1
        self._event_end = 0
        self._id_start = -1
        self._id_end = 0
        self._last_id: str | None = None
        #: The reconnection time, in milliseconds, last set by a valid
        #: ``retry`` field, or ``None``.
        self.retry: int | None = None

    @property
    def pending_bytes(self) -> int:
        """How many bytes of an incomplete block are held back."""
        return len(self._buf)

    def held(self) -> bytes:
        """A copy of the incomplete block's bytes (what a cut now would drop)."""
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> list[Frame]:
        """Consume ``chunk`` and return the frames it completed."""
        if self._failed:
            raise EventTooLarge(len(self._buf), self._limit or 0, [])
        if not self._buf and not self._stream_start and not self._skip_lf:
            whole = self._whole_event(chunk)
            if whole is not None:
                return whole
        buf = self._buf
        buf += chunk
        if self._stream_start and not self._past_bom(buf):
            return []
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
        pos, block_start = self._parse_lines(buf, pos, block_start, frames)
        self._scanned = n - block_start  # _parse_lines stops where no line ending is left
        if block_start:
            del buf[:block_start]
            pos -= block_start
            # The offsets into the block left in the buffer move with it.
            if self._data_lines:
                self._data_start -= block_start
                self._data_end -= block_start
                more = self._more_data
                for i in range(len(more)):
                    more[i] -= block_start
            if self._event_start >= 0:
                self._event_start -= block_start
                self._event_end -= block_start
            if self._id_start >= 0:
                self._id_start -= block_start
                self._id_end -= block_start
        self._pos = pos
        limit = self._limit
        if limit is not None and len(buf) > limit:
            self._fail(len(buf), frames)
        return frames

    def _past_bom(self, buf: bytearray) -> bool:
        """At the stream's start: strip its byte order mark; False while it may be one.

        The BOM may itself arrive split across chunks: wait for three bytes
        (or a mismatch) before deciding. Once one is stripped, decide the
        same way whether a second one follows; if so, both are kept (see
        the divergences above).
        """
        if len(buf) < 3 and _BOM.startswith(buf):
            return False
        if not self._bom_stripped and buf.startswith(_BOM):
            del buf[:3]
            self._bom_stripped = True
            if len(buf) < 3 and _BOM.startswith(buf):
                return False
        self._stream_start = False
        if self._bom_stripped and buf.startswith(_BOM):
            buf[:0] = _BOM
        return True

    def _parse_lines(
        self, buf: bytearray, pos: int, block_start: int, frames: list[Frame]
    ) -> tuple[int, int]:
        """Parse the whole lines in ``buf`` from ``pos``; append the blocks they end to ``frames``.

        Returns where the first incomplete line starts and where the first
        incomplete block does (``block_start``: the bytes before it are done).
        """
        n = len(buf)
        limit = self._limit
        scan_from = max(pos, self._scanned)
        lf = buf.find(b"\n", scan_from)
        cr = buf.find(b"\r", scan_from)
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
                event = self._dispatch(buf, block_start, pos)
                raw = (
                    bytes(buf[block_start:nxt])
                    if nxt - block_start < _VIEW_COPY_BYTES
                    else _copy(buf, block_start, nxt)
                )
                frames.append(Frame(raw, event))
                block_start = nxt
            elif buf.startswith(b"data:", pos, eol) and not self._data_lines:
                # The line nearly every event has, inline: see _field.
                value_start = pos + 5
                if value_start < eol and buf[value_start] == _SPACE:
                    value_start += 1
                self._data_start = value_start
                self._data_end = eol
                self._data_lines = 1
            elif buf[pos] != 0x3A:  # lines starting with ":" are comments
                self._field(buf, pos, eol)
            pos = nxt
        return pos, block_start

    def _whole_event(self, chunk: bytes) -> list[Frame] | None:
        """The one event ``chunk`` is, if it is exactly one plain event; else ``None``.

        Most upstream reads are exactly one event (``data: ...`` or
        ``event: ...`` then ``data: ...``, LF line ends) arriving with
        nothing held: that read needs no buffer, no line loop and no copy.
        Anything else (CR, more lines or events, other fields, a partial
        block) takes the general path, to the same result.
        """
        n = len(chunk)
        limit = self._limit
        # An int searched for in bytes is a memchr; ``b"\r" in chunk`` first
        # tries the bytes as an integer, and CPython raises and clears a
        # TypeError inside: about 2,000 instructions, a fifteenth of the
        # sidecar's own per event. ``bytes.find`` parses its arguments as a
        # tuple (about 1,000): the one-line test is a memchr on a copy.
        if (
            n < 7
            or not chunk.endswith(b"\n\n")
            or (limit is not None and n > limit)
            or _CR in chunk
        ):
            return None
        if chunk.startswith(b"data:"):
            start = 6 if chunk[5] == _SPACE else 5
            data = _text(chunk[start : n - 2])
            # An LF decodes to an LF and nothing else does: one test on the
            # text the event needs anyway, not a copy of the bytes to test.
            if "\n" in data:
                return None  # more lines than one
            return [Frame(chunk, Event("message", data, self._last_id))]
        first = chunk.find(b"\n")
        if chunk.find(b"\n", first + 1) != n - 2:
            return None
        if not chunk.startswith(b"event:") or not chunk.startswith(b"data:", first + 1):
            return None
        name_start = 7 if chunk[6] == _SPACE else 6
        kind = _text(chunk[name_start:first]) or "message"
        value = first + 6  # past "data:" on the second line
        if chunk[value] == _SPACE:
            value += 1
        data = _text(chunk[value : n - 2])
        return [Frame(chunk, Event(kind, data, self._last_id))]

    def close(self) -> list[Frame]:
        """End of stream. An unterminated final block is dropped, not dispatched."""
        self._buf.clear()
        self._pos = 0
        self._forget_block()
        return []

    def _fail(self, size: int, frames: list[Frame]) -> None:
        self._failed = True
        self._buf.clear()
        self._pos = 0
        self._forget_block()
        raise EventTooLarge(size, self._limit or 0, frames)

    def _forget_block(self) -> None:
        self._scanned = 0
        self._data_lines = 0
        self._more_data.clear()
        self._event_start = -1
        self._id_start = -1

    def _field(self, buf: bytearray, start: int, end: int) -> None:
        # Field names are compared in place (length, then bytes): copying
        # each name out would cost an allocation per line, and a name can be
        # as long as the line.
        colon = buf.find(b":", start, end)
        if colon == -1:
            size = end - start
            value_start = end
        else:
            size = colon - start
            value_start = colon + 1
            if value_start < end and buf[value_start] == _SPACE:
                value_start += 1
        if size == 4:
            if buf.startswith(b"data", start):
                lines = self._data_lines
                if not lines:
                    self._data_start = value_start
                    self._data_end = end
                elif lines <= _TRACKED_DATA_LINES:
                    self._more_data += (value_start, end)
                self._data_lines = lines + 1
        elif size == 5:
            if buf.startswith(b"event", start):
                self._event_start = value_start
                self._event_end = end
            elif buf.startswith(b"retry", start):
                self._retry(buf, value_start, end)
        elif (
            size == 2
            and buf.startswith(b"id", start)
            # NUL is ASCII and never the result of decoding, so looking for
            # it in the bytes is the spec's check on the decoded value.
            and buf.find(b"\x00", value_start, end) == -1
        ):
            self._id_start = value_start
            self._id_end = end
        # Any other field name is ignored, as the spec requires.

    def _retry(self, buf: bytearray, start: int, end: int) -> None:
        digits = _RETRY_DIGITS.fullmatch(buf, start, end)
        if digits is None:
            return
        # Python converts at most sys.get_int_max_str_digits() digits (4,300
        # by default) and raises ValueError beyond: from an upstream's bytes
        # that would break the stream. Such a value (leading zeros aside)
        # means nothing as milliseconds and is ignored, keeping the previous
        # one, as a browser ignores a value that overflows its integer.
        first, last = digits.span(1)
        if last - first <= _MAX_RETRY_DIGITS:
            with contextlib.suppress(ValueError):  # a lower limit set by the application
                self.retry = int(buf[first:last])

    def _dispatch(self, buf: bytearray, start: int, end: int) -> Event | None:
        """The event of the block whose field lines are ``buf[start:end]``."""
        if self._id_start >= 0:
            self._last_id = _decode(buf, self._id_start, self._id_end)
            self._id_start = -1
        event_start = self._event_start
        self._event_start = -1
        lines = self._data_lines
        if not lines:
            return None
        self._data_lines = 0
        if lines == 1:
            start, end = self._data_start, self._data_end
            data = (
                buf[start:end].decode("utf-8", "replace")
                if end - start < _VIEW_COPY_BYTES
                else _decode(buf, start, end)
            )
        elif lines == 2:  # the usual multi-line event: its data had one LF
            more = self._more_data
            first = buf[self._data_start : self._data_end]
            data = b"\n".join((first, buf[more[0] : more[1]])).decode("utf-8", "replace")
            more.clear()
        else:
            more = self._more_data
            if lines <= _TRACKED_DATA_LINES + 1:
                data = _joined(buf, [self._data_start, self._data_end, *more])
            else:
                data = _rescanned_data(buf, start, end)
            more.clear()
        event_type = _decode(buf, event_start, self._event_end) if event_start >= 0 else ""
        return Event(event_type or "message", data, self._last_id)


# How many data lines after the first one a block tracks by offsets.
_TRACKED_DATA_LINES = 15
# A retry value: ASCII digits only (bytes patterns match ASCII digits only),
# with the leading zeros apart so that they do not count toward the limit.
_RETRY_DIGITS = re.compile(rb"0*([0-9]+)")
_MAX_RETRY_DIGITS = 4300
# Slices at least this long are copied through a memoryview, once, instead
# of through an intermediate bytearray: for a block near max_event_bytes
# the second copy would be another max_event_bytes at its peak.
_VIEW_COPY_BYTES = 64 * 1024


def _copy(buf: bytearray, start: int, end: int) -> bytes:
    with memoryview(buf) as view:
        return bytes(view[start:end])


def _decode(buf: bytearray, start: int, end: int) -> str:
    # Invalid sequences become U+FFFD, as the spec's UTF-8 decode requires.
    if end - start < _VIEW_COPY_BYTES:
        return buf[start:end].decode("utf-8", "replace")
    with memoryview(buf) as view:
        return str(view[start:end], "utf-8", "replace")


def _text(raw: bytes) -> str:
    """``raw`` decoded as :func:`_decode` does, the cheap way for valid UTF-8.

    The strict decode is one direct call in the compiled build; naming an
    error handler makes CPython look the codec up by its name on every call
    (about 300 instructions an event). Only invalid bytes pay twice.
    """
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace")


def _joined(buf: bytearray, spans: list[int]) -> str:
    """The values at ``spans`` (start, end, start, end...) joined by LF, decoded once.

    Line endings are ASCII, so decoding the joined bytes gives what decoding
    each value would; gathering bytes costs one buffer no larger than the
    block, where a string per line cost several times that.
    """
    data = bytearray()
    for i in range(0, len(spans), 2):
        if i:
            data += b"\n"
        data += buf[spans[i] : spans[i + 1]]
    return data.decode("utf-8", "replace")


def _rescanned_data(buf: bytearray, start: int, end: int) -> str:
    """As :func:`_joined`, for a block with more data lines than are tracked.

    ``buf[start:end]`` holds the block's field lines, each with its line
    ending; they are scanned once more, and the values gathered as they are
    found (a list of their offsets would cost more than the block itself).
    """
    data = bytearray()
    first = True
    pos = start
    # As in feed: each kind of line ending is looked for again only once the
    # one found is behind, so the block is scanned once, not once per line.
    lf = buf.find(b"\n", pos, end)
    cr = buf.find(b"\r", pos, end)
    while pos < end:
        if lf != -1 and lf < pos:
            lf = buf.find(b"\n", pos, end)
        if cr != -1 and cr < pos:
            cr = buf.find(b"\r", pos, end)
        if cr != -1 and (lf == -1 or cr < lf):
            eol = cr
            nxt = cr + 2 if cr + 1 < end and buf[cr + 1] == _LF else cr + 1
        else:
            # Every line in the block is terminated, so an LF is there.
            eol = lf
            nxt = lf + 1
        colon = buf.find(b":", pos, eol)
        name_end = eol if colon == -1 else colon
        if name_end - pos == 4 and buf.startswith(b"data", pos):
            value_start = colon + 1 if colon != -1 else eol
            if value_start < eol and buf[value_start] == _SPACE:
                value_start += 1
            if not first:
                data += b"\n"
            data += buf[value_start:eol]
            first = False
        pos = nxt
    return data.decode("utf-8", "replace")


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

    __slots__ = ("_buf", "_failed", "_limit", "_scanned")

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._limit = max_event_bytes
        self._buf = bytearray()
        # How much of the held, unfinished line is known to have no LF: a
        # line that arrives over many reads is searched once, not per read.
        self._scanned = 0
        self._failed = False

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)

    def held(self) -> bytes:
        """A copy of the unfinished line's bytes (what a cut now would drop)."""
        return bytes(self._buf)

    def feed(self, chunk: bytes) -> list[Frame]:
        if self._failed:
            raise EventTooLarge(len(self._buf), self._limit or 0, [])
        buf = self._buf
        buf += chunk
        frames: list[Frame] = []
        limit = self._limit
        start = 0
        scan = self._scanned
        while (lf := buf.find(b"\n", scan)) != -1:
            end = lf + 1
            if limit is not None and end - start > limit:
                self._fail(end - start, frames)
            if end - start < _VIEW_COPY_BYTES:
                frames.append(_line_frame(bytes(buf[start:end])))
            else:
                frames.append(_large_line_frame(buf, start, end))
            start = scan = end
        self._scanned = len(buf) - start
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
        self._scanned = 0
        return []

    def _fail(self, size: int, frames: list[Frame]) -> None:
        self._failed = True
        self._buf.clear()
        self._scanned = 0
        raise EventTooLarge(size, self._limit or 0, frames)


def _line_frame(raw: bytes) -> Frame:
    # Only the line's own ending goes: its LF and one CR before it. A CR
    # further back is part of the line.
    text = raw.removesuffix(b"\n").removesuffix(b"\r")
    if not text.strip():
        return Frame(raw, None)
    return Frame(raw, Event("message", text.decode("utf-8", "replace"), None))


# What bytes.strip() strips: a line of nothing else is blank.
_ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"
_BLANK = re.compile(b"[" + re.escape(_ASCII_WHITESPACE) + b"]*")


def _large_line_frame(buf: bytearray, start: int, end: int) -> Frame:
    """As :func:`_line_frame`, for the line ``buf[start:end]``, read in place.

    The small-line way copies the line three or four times over (slices,
    suffixes, the blank check); for a line near ``max_event_bytes`` each
    copy would be that much memory again.
    """
    raw = _copy(buf, start, end)
    stop = end - 1
    if buf[stop - 1] == _CR:  # a large line has bytes before its LF
        stop -= 1
    if buf[start] in _ASCII_WHITESPACE and _BLANK.fullmatch(buf, start, stop) is not None:
        return Frame(raw, None)
    return Frame(raw, Event("message", _decode(buf, start, stop), None))


_RAW_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def with_data(raw: bytes, data: str, *, lines: bool = False, message: bool = False) -> bytes:
    """A frame's raw bytes with its event's data replaced by ``data``, all else kept.

    For an SSE block the first ``data`` line becomes one line per line of
    ``data``, with the same line ending, and later ``data`` lines go; every
    other line (``event``, ``id``, comments) and the blank line that ends
    the block stay as they were. For a line (``lines``), the line's text is
    replaced and its ending kept. For a message (``message``: a WebSocket's,
    :class:`MessageFramer`) the bytes are the data and nothing else.
    """
    if message:
        return data.encode()
    if lines:
        ending = b"\r\n" if raw.endswith(b"\r\n") else b"\n"
        return data.encode() + ending
    out: list[bytes] = []
    placed = False
    for match in _RAW_LINE.finditer(raw):
        line = match.group()
        body = line.rstrip(b"\r\n")
        if body == b"data" or body.startswith(b"data:"):
            if not placed:
                ending = line[len(body) :]
                out.extend(b"data: " + part.encode() + ending for part in data.split("\n"))
                placed = True
            continue
        out.append(line)
    return b"".join(out)


class MessageFramer:
    """The frames of a transport that frames its messages itself (a WebSocket's text messages).

    Each ``feed`` is one whole message, and so one frame: its bytes as they
    came, one event whose data is its text (the Responses API sends its SSE
    events' data as messages). Nothing is ever held between messages; one
    over ``max_event_bytes`` raises :class:`EventTooLarge`, as a block does.
    """

    __slots__ = ("_limit",)

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._limit = max_event_bytes

    @property
    def pending_bytes(self) -> int:
        return 0

    def held(self) -> bytes:
        return b""

    def feed(self, chunk: bytes) -> list[Frame]:
        if self._limit is not None and len(chunk) > self._limit:
            raise EventTooLarge(len(chunk), self._limit, [])
        return [Frame(chunk, Event("message", chunk.decode("utf-8", "replace")))]

    def close(self) -> list[Frame]:
        return []
