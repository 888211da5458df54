"""The stream plan: decided once per exchange, in the core, for both faces.

Whether a request asks for a stream, and whether its response is one (and
how it is framed and encoded), used to be worked out in three places with
three slightly different answers. Here it is decided once, from the
request and the response head alone, and the faces and the
:class:`~streamwarden.core.relay.Relay` take the decision as given.

A response is relayed as a stream when all of these hold:

- the request was not ``HEAD`` and the status can carry a body (not 1xx,
  204 or 304);
- its media type (or a Vercel AI stream header) says it is a stream:
  ``text/event-stream``, ``application/x-ndjson``, or one of the
  configured ``stream_media_types``;
- its ``Content-Encoding`` is one this project inflates (identity, gzip,
  x-gzip, deflate). Both faces inflate those, with a bounded output per
  step (:mod:`streamwarden.core.inflate`), and forward the events uncompressed:
  a compressed event stream is batched by the compressor, which is exactly
  what a stream must not be. Any other encoding (br, zstd) is passed through
  untouched, as a body that is not a stream.

With early headers (``early_headers_after``) a face commits
:data:`EARLY_PLAN` before its upstream (or app) answers; what answers later
must then fit that head, and :func:`early_refusal` is the one rule, for
both faces, of which answers cannot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from streamwarden.core.dialects import Framing, asks_for_stream, stream_framing

__all__ = [
    "EARLY_PLAN",
    "MESSAGES_PLAN",
    "Encoding",
    "StreamPlan",
    "asks_for_stream",
    "early_refusal",
    "plan_response",
    "response_encoding",
]

Encoding = Literal["identity", "gzip", "deflate"]

_ENCODINGS: dict[str, Encoding] = {
    "": "identity",
    "identity": "identity",
    "gzip": "gzip",
    "x-gzip": "gzip",
    "deflate": "deflate",
}

# Statuses whose responses never carry a body (RFC 9110 section 6.4.1).
_NO_BODY = frozenset({204, 304})


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """How one streamed response is relayed."""

    #: SSE blocks or newline-delimited lines.
    framing: Framing
    #: The body's content coding, inflated before the relay sees it.
    encoding: Encoding
    #: The response's ``Content-Type`` (for dialect detection and the log).
    content_type: str | None

    @property
    def decoded(self) -> bool:
        """Whether the body reaches the client decoded (``Content-Encoding`` dropped)."""
        return self.encoding != "identity"


def response_encoding(value: str | None) -> Encoding | None:
    """The content coding named by a ``Content-Encoding`` value, or ``None`` if not ours."""
    return _ENCODINGS.get((value or "").strip().lower())


def plan_response(
    method: str,
    status: int,
    headers: Mapping[str, str],
    extra_media_types: frozenset[str] = frozenset(),
) -> StreamPlan | None:
    """The plan for relaying a response as a stream, or ``None`` to pass it through.

    ``headers`` must be case-insensitive (aiohttp's, Starlette's) or use
    lower-case names. ``extra_media_types`` are the configured
    ``stream_media_types``, lower-cased.
    """
    if method == "HEAD" or status < 200 or status in _NO_BODY:
        return None
    content_type = headers.get("content-type")
    framing = stream_framing(content_type, headers, extra_media_types)
    if framing is None:
        return None
    encoding = response_encoding(headers.get("content-encoding"))
    if encoding is None:
        return None
    return StreamPlan(framing, encoding, content_type)


#: The plan of a head committed before the upstream answered (early headers):
#: an event stream, uncompressed, its dialect left to the request's path.
EARLY_PLAN = StreamPlan("sse", "identity", "text/event-stream; charset=utf-8")


#: The plan of the streams a WebSocket's messages carry (the Responses API's):
#: each text message is one whole event, and goes on as it came.
MESSAGES_PLAN = StreamPlan("messages", "identity", None)


def early_refusal(
    method: str,
    status: int,
    headers: Mapping[str, str],
    extra_media_types: frozenset[str] = frozenset(),
) -> str | None:
    """Why a late answer cannot follow the committed :data:`EARLY_PLAN` head, or ``None``.

    Only an uncompressed event stream with a status below 400 can: the
    client already has ``200 text/event-stream``, so an error status, a body
    that is not an event stream, or a compressed one (the stream was opened
    with the committed plan, which inflates nothing) can only end the
    stream with an error event, whose message this is. ``headers`` as for :func:`plan_response`.
    """
    answered = plan_response(method, status, headers, extra_media_types)
    if status < 400 and answered is not None and answered.framing == "sse":
        if answered.decoded:
            return "the upstream answered with a compressed stream"
        return None
    kind = headers.get("content-type") or "no content type"
    return f"the upstream answered HTTP {status} ({kind})"
