"""The answers a face gives itself instead of the upstream's (or the app's).

One table for both faces: each refusal's status, machine code, message and
extra headers live here and nowhere else. The body is small JSON in the
shape most LLM clients already read (``{"error": {"code", "message"}}``).
Refusals happen only before a response has started; after that, failures
are error events in the stream's dialect (:mod:`streamwarden.core.relay`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Refusal", "RefusalKind", "refusal_body"]


def refusal_body(code: str, message: str) -> bytes:
    """The small JSON body of an error a face answers itself."""
    return json.dumps(
        {"error": {"code": code, "message": f"streamwarden: {message}"}}, separators=(",", ":")
    ).encode()


@dataclass(frozen=True, slots=True)
class Refusal:
    """One answer: status, machine code, message template and extra headers."""

    status: int
    code: str
    message: str
    headers: tuple[tuple[str, str], ...] = field(default=())

    def body(self, **values: object) -> bytes:
        return refusal_body(self.code, self.message.format(**values))


class RefusalKind(Enum):
    """Every refusal either face answers itself."""

    METHOD_NOT_ALLOWED = Refusal(405, "method_not_allowed", "CONNECT is not proxied")
    BAD_REQUEST_TARGET = Refusal(400, "bad_request_target", "only origin-form request targets")
    EXPECTATION_FAILED = Refusal(
        417, "expectation_failed", "only the expectation 100-continue is understood"
    )
    REQUEST_TOO_LARGE = Refusal(413, "request_too_large", "request body over {limit} bytes")
    REQUEST_BODY_INCOMPLETE = Refusal(
        400, "request_body_incomplete", "the request body ended before its end"
    )
    TOO_MANY_STREAMS = Refusal(
        503, "too_many_streams", "{limit} streams are open", (("Retry-After", "1"),)
    )
    TOO_MANY_CONNECTIONS = Refusal(
        503, "too_many_connections", "{limit} client connections are open", (("Retry-After", "1"),)
    )
    UPSTREAM_UNREACHABLE = Refusal(502, "upstream_unreachable", "the upstream could not be reached")
    UPSTREAM_TIMEOUT = Refusal(504, "upstream_timeout", "the upstream did not answer in time")
    WEBSOCKET_REFUSED = Refusal(502, "upstream_refused", "websocket handshake refused")
    UNKNOWN_STREAM = Refusal(404, "unknown_stream", "no such stream is running here")

    @property
    def refusal(self) -> Refusal:
        value: Refusal = self.value
        return value
