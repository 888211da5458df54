"""A plain event stream with no LLM framing, served at ``GET /sse``.

Each token is one ``event: tick`` with an increasing ``id:`` and the token
text as ``data:`` (a token holding line breaks becomes several ``data:``
lines, which a decoder joins back). There is no terminal event: the stream
ends cleanly at EOF, which is what a relay must treat as a normal end for
streams of an unknown dialect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from streamwarden.tools.mock.formats.base import Answer, Frame, FrameRole, WireFormat, compact_json

__all__ = ["GenericSSE"]


class GenericSSE(WireFormat):
    """``GET /sse``."""

    name: ClassVar[str] = "generic"
    dialect: ClassVar[str] = "generic"
    content_type: ClassVar[str] = "text/event-stream"
    default_model: ClassVar[str] = "none"
    replies_whole: ClassVar[bool] = False

    def stream_headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Cache-Control": "no-cache"}

    def wants_stream(self, body: Mapping[str, Any], path: str) -> bool:
        return True

    def preamble(self, answer: Answer) -> list[Frame]:
        return []

    def token(self, answer: Answer, index: int, piece: str) -> Frame:
        lines = ["event: tick", f"id: {index + 1}"]
        lines.extend(f"data: {line}" for line in piece.split("\n"))
        return Frame(("\n".join(lines) + "\n\n").encode(), FrameRole.TOKEN, tokens=1)

    def closing(self, answer: Answer) -> list[Frame]:
        return []

    def reply(self, answer: Answer) -> None:
        return None

    def error(self, status: int, message: str) -> bytes:
        return compact_json({"error": {"message": message, "code": status}}).encode()
