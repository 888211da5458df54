"""A deliberately simple reference for WHATWG HTML §9.2.6 "Interpreting an event stream".

It takes the whole stream at once and follows the specification's prose
step by step, with no incremental state, no byte-level tricks and no
concern for speed, so that it can be checked by reading it next to the
specification. The conformance and property tests compare
:mod:`streamwarden.core.sse` against it.

Written from the specification text, not from ``streamwarden.core.sse``; only
the :class:`~streamwarden.core.sse.Event` type is shared, so that results compare
directly.
"""

from __future__ import annotations

import re

from streamwarden.core.sse import Event

# "a U+000D CARRIAGE RETURN U+000A LINE FEED (CRLF) character pair, a single
# U+000A LINE FEED (LF) character not preceded by a U+000D CARRIAGE RETURN
# (CR) character, and a single U+000D CARRIAGE RETURN (CR) character not
# followed by a U+000A LINE FEED (LF) character". Alternation tries CRLF first.
_END_OF_LINE = re.compile("\r\n|\n|\r")


def reference_lines(text: str) -> list[str]:
    """Split decoded text into its terminated lines, without their line endings.

    The characters after the last line ending (if any) are an unfinished
    line, which the end of the stream discards, so they are left out.
    """
    pieces = _END_OF_LINE.split(text)
    pieces.pop()  # what follows the last line ending: "" or an unfinished line
    return pieces


_BYTES_END_OF_LINE = re.compile(b"\r\n|\n|\r")


def block_boundary(stream: bytes) -> int:
    """The length of the longest prefix of ``stream`` that ends with a blank line.

    That prefix holds only whole blocks: a reader (or a framer) that has
    seen it is between blocks, with nothing held back. What follows is an
    unfinished block, or nothing. Line endings are ASCII bytes, so this
    works on the raw bytes. Pass the stream as a framer forwards it, without
    its leading BOM (a BOM left in place is part of the first line).
    """
    boundary = 0
    line_start = 0
    for ending in _BYTES_END_OF_LINE.finditer(stream):
        if ending.start() == line_start:  # an empty line: the end of a block
            boundary = ending.end()
        line_start = ending.end()
    return boundary


def reference_decode(stream: bytes) -> tuple[list[Event], int | None]:
    """Interpret a complete event stream.

    Returns the dispatched events and the final reconnection time (the value
    of the last valid ``retry`` field, or ``None``). ``Event.id`` is the last
    event ID buffer at dispatch: ``None`` while no ``id`` field has been
    accepted.
    """
    # "Streams must be decoded using the UTF-8 decode algorithm", which
    # replaces invalid sequences with U+FFFD and "strips one leading UTF-8
    # Byte Order Mark (BOM), if any".
    text = stream.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]

    # "a data buffer, an event type buffer, and a last event ID buffer ...
    # must be initialized to the empty string." The last event ID buffer is
    # None until set, so that "never set" and "set to empty" stay apart.
    data_buffer = ""
    event_type_buffer = ""
    last_event_id_buffer: str | None = None
    reconnection_time: int | None = None
    events: list[Event] = []

    lines = reference_lines(text)
    # "Once the end of the file is reached, any pending data must be
    # discarded": the unterminated tail never reaches this loop, and
    # whatever the buffers hold when the loop ends is never dispatched.
    for line in lines:
        if line == "":
            # Dispatch the event.
            if data_buffer == "":
                data_buffer = ""
                event_type_buffer = ""
                continue
            if data_buffer.endswith("\n"):
                data_buffer = data_buffer[:-1]
            event_type = event_type_buffer if event_type_buffer != "" else "message"
            events.append(Event(event=event_type, data=data_buffer, id=last_event_id_buffer))
            data_buffer = ""
            event_type_buffer = ""
            continue

        if line.startswith(":"):
            continue  # a comment

        if ":" in line:
            field, value = line.split(":", 1)
            if value.startswith(" "):
                value = value[1:]
        else:
            field, value = line, ""

        # "Field names must be compared literally, with no case folding."
        if field == "event":
            event_type_buffer = value
        elif field == "data":
            data_buffer += value + "\n"
        elif field == "id":
            if "\x00" not in value:
                last_event_id_buffer = value
        elif field == "retry" and value != "" and all(c in "0123456789" for c in value):
            # "If the field value consists of only ASCII digits"; an empty
            # value sets nothing. Any other retry value is ignored.
            reconnection_time = int(value, 10)
        # Otherwise the field is ignored.

    return events, reconnection_time
