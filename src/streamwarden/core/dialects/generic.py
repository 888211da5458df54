"""Any other event stream: no known terminal event, so a clean end is a clean end.

Every data event counts as content (its data is the text for the token
estimate, and the text output filters read: JSON written with escapes is
read decoded, as its reader's parser gives it). Failures the relay detects
still become an ``event: error`` with a JSON ``{"error": {...}}`` body,
which ``EventSource`` pages can listen for by name and generic SSE clients
can recognise by its data.
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    DecodedJSON,
    Dialect,
    Observation,
    RawText,
    dump_json,
    read_as_text,
    sse_block,
)
from streamwarden.core.sse import Event


class Generic(Dialect):
    __slots__ = ()

    name = "generic"
    # Never named in a message: with no terminal event expected, the only
    # truncation is an unfinished event, and the relay says that instead.
    terminal_event = "no terminal event"
    # Nobody's client is known to raise on an ``event: error``.
    error_event_raises = False

    def __init__(self) -> None:
        super().__init__()
        self.expects_terminal = False

    def inspect(self, event: Event) -> Observation:
        return Observation(text=event.data) if event.data else Observation()

    def load_data(self, event: Event, loads: Any = None) -> RawText | DecodedJSON:
        return read_as_text(event.data)  # the data is the text, JSON or not

    def reads_own_texts(self, event: Event) -> bool:
        return "\\" in event.data  # an escape: the filters read the data decoded

    def error_event(self, code: str, message: str) -> bytes:
        return sse_block(dump_json({"error": {"code": code, "message": message}}), event="error")
