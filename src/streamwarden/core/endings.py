"""How a stream ends: the codes of its error events, and what each means.

One table (:data:`ENDINGS`) says, for every code a synthesized error
event can carry, which end state the stream gets and what the client is
told. The :class:`~streamwarden.core.relay.Relay` decides *when* a stream
ends; this module is *what* that ending says, in one place.
"""

from __future__ import annotations

from enum import StrEnum

from streamwarden.core.meter import EndState

__all__ = [
    "BEFORE_TERMINAL",
    "ENDINGS",
    "KEEP_CODE",
    "NESTED_TOO_DEEP",
    "TRUNCATED_INSIDE",
    "ErrorCode",
]


class ErrorCode(StrEnum):
    """Machine-readable codes of synthesized error events."""

    STREAM_TRUNCATED = "stream_truncated"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    DURATION_EXCEEDED = "duration_exceeded"
    EVENT_TOO_LARGE = "event_too_large"
    SHUTTING_DOWN = "shutting_down"
    CONTENT_BLOCKED = "content_blocked"
    # A tool call's arguments: cut, closed broken, over max_tool_arguments_bytes.
    TOOL_CALL_TRUNCATED = "tool_call_truncated"
    TOOL_CALL_INVALID = "tool_call_invalid"
    TOOL_CALL_TOO_LARGE = "tool_call_too_large"
    # Answers to a resume (no stream is relayed: see streamwarden.features.resume.model).
    RESUME_EXPIRED = "resume_expired"
    RESUME_GAP = "resume_gap"
    RESUME_UNAVAILABLE = "resume_unavailable"


#: What each code means for the stream's end state, and what the client is told.
ENDINGS: dict[ErrorCode, tuple[EndState, str]] = {
    ErrorCode.STREAM_TRUNCATED: (
        EndState.UPSTREAM_TRUNCATED,
        "the upstream ended the stream without {terminal}",
    ),
    ErrorCode.UPSTREAM_ERROR: (EndState.UPSTREAM_ERROR, "the upstream broke off the stream"),
    ErrorCode.UPSTREAM_TIMEOUT: (
        EndState.UPSTREAM_TIMEOUT,
        "the upstream sent nothing for {idle:g}s",
    ),
    ErrorCode.DURATION_EXCEEDED: (
        EndState.LIMIT_EXCEEDED,
        "the stream reached its maximum duration of {duration:g}s",
    ),
    ErrorCode.EVENT_TOO_LARGE: (
        EndState.LIMIT_EXCEEDED,
        "an upstream event exceeded the limit of {event_bytes} bytes",
    ),
    ErrorCode.SHUTTING_DOWN: (EndState.SHUTDOWN, "the proxy is shutting down"),
    ErrorCode.CONTENT_BLOCKED: (EndState.BLOCKED, "an output filter blocked the answer"),
    # (Their reasons name the call: see streamwarden.core.calls.)
    ErrorCode.TOOL_CALL_TRUNCATED: (EndState.UPSTREAM_TRUNCATED, "a tool call was cut"),
    ErrorCode.TOOL_CALL_INVALID: (EndState.UPSTREAM_ERROR, "a tool call was closed broken"),
    ErrorCode.TOOL_CALL_TOO_LARGE: (EndState.LIMIT_EXCEEDED, "a tool call was too large"),
}
#: The codes a call still open does not turn into tool_call_truncated: a
#: filter's block (which says more) and the tool calls' own.
KEEP_CODE = frozenset(
    {
        ErrorCode.CONTENT_BLOCKED,
        ErrorCode.TOOL_CALL_TRUNCATED,
        ErrorCode.TOOL_CALL_INVALID,
        ErrorCode.TOOL_CALL_TOO_LARGE,
    }
)
#: A truncation inside a block or line says so: for a dialect with no terminal
#: event that is the whole story, for the others it comes before the terminal.
TRUNCATED_INSIDE = "the upstream ended the stream inside an unfinished {unit}"
BEFORE_TERMINAL = ", before {terminal}"
NESTED_TOO_DEEP = "an upstream event nested deeper than the proxy reads"
