"""Newline-delimited JSON streams (``application/x-ndjson``), as Ollama sends them.

Each line is one JSON object: ``message.content`` (``/api/chat``) or
``response`` (``/api/generate``) carries the text, and the last line has
``"done": true`` with ``eval_count``, the generated tokens. Other NDJSON
streams have no terminal line at all, so the terminal is expected only once
a line shows the Ollama shape (a ``done`` key); until then a clean end of
stream is a clean end.

Ollama's clients raise on a line with an ``error`` string, which is the
shape of the synthesized error (plus a ``code`` beside it).
"""

from __future__ import annotations

from typing import Any

from streamwarden.core.dialects.base import (
    MAIN_TEXT,
    NOTHING,
    UPSTREAM_ERROR,
    DecodedJSON,
    Dialect,
    Observation,
    RawText,
    TextPlace,
    as_int,
    dump_json,
    load_json,
    read_as_text,
)
from streamwarden.core.sse import Event


class NDJSON(Dialect):
    __slots__ = ()

    name = "ndjson"
    tool_marks = ('"tool_calls"',)
    framing = "lines"
    terminal_event = 'a "done": true line'

    def __init__(self) -> None:
        super().__init__()
        self.expects_terminal = False

    def inspect(self, event: Event) -> Observation:
        obj = load_json(event.data)
        if not isinstance(obj, dict):
            return Observation(text=event.data)
        if obj.get("error"):
            return UPSTREAM_ERROR
        if "done" not in obj:
            return Observation(text=event.data)
        self.expects_terminal = True
        message = obj.get("message")
        text = message.get("content") if isinstance(message, dict) else obj.get("response")
        thinking = message.get("thinking") if isinstance(message, dict) else obj.get("thinking")
        content = (text if isinstance(text, str) else "") + (
            thinking if isinstance(thinking, str) else ""
        )
        if obj.get("done") is True:
            return Observation(
                content,
                as_int(obj.get("eval_count")),
                as_int(obj.get("prompt_eval_count")),
                terminal=True,
            )
        return Observation(text=content) if content else NOTHING

    def error_event(self, code: str, message: str) -> bytes:
        return (dump_json({"error": message, "code": code}) + "\n").encode()

    def text_places(self, root: Any, event: Event, tool_arguments: bool) -> list[TextPlace]:
        # The same text as inspect: a line in Ollama's shape has its content
        # and thinking; any other line is text as a whole (see load_data).
        if isinstance(root, RawText):
            return [(root, 0, MAIN_TEXT)] if root[0] else []
        if isinstance(root, DecodedJSON):
            return [(root, 0, MAIN_TEXT)]
        message = root.get("message")
        holder = message if isinstance(message, dict) else root
        fields = ("content", "thinking") if holder is message else ("response", "thinking")
        return [(holder, f, MAIN_TEXT) for f in fields if isinstance(holder.get(f), str)]

    def load_data(self, event: Event, loads: Any = None) -> Any:
        # Only a line in Ollama's shape is read as JSON; any other line, an
        # object without "done" too, is its own text, kept as the line itself,
        # so that a redaction is made in what is dumped again.
        root = super().load_data(event, loads)
        return root if isinstance(root, dict) and "done" in root else read_as_text(event.data)

    def reads_own_texts(self, event: Event) -> bool:
        return "\\" in event.data  # a line of no Ollama shape is read decoded
