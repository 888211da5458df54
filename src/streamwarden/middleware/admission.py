"""Whether a request asks for a stream, and whether it gets one of ``max_concurrent_streams``.

A request asks for a stream by the rule the sidecar uses
(:func:`~streamwarden.core.dialects.asks_for_stream`): ``Accept:
text/event-stream``, ``alt=sse``, or ``"stream": true`` in its body. The
headers and query are read at once; the body is looked at as it goes by,
message by message, on its way to the app (through the
:class:`~streamwarden.middleware.inbox.Inbox`), with the last bytes of each
message kept so that a ``"stream": true`` split across two is still seen.
No body is read for this alone: with no limit set, the app's own reads are
all there is, so a request that never becomes a stream costs one look at
its headers.

What the answer is used for:

- a request that asks for a stream is watched for its client leaving from
  the moment its whole body has been read (at once, if it has none); the
  responder is told through ``on_stream_asked``;
- with ``max_concurrent_streams`` set, such a request takes a slot before
  the app runs, or is refused with ``503`` and ``Retry-After`` and the app
  never runs. To see ``"stream": true`` in time, the first body message is
  read here, before the app, and handed back to it as its first
  ``receive()``. The responder gives the slot back when the response
  starts as something other than a stream, or as the stream's last bytes
  leave (or its client is gone), and at the latest when the app returns.
"""

from __future__ import annotations

from collections.abc import Callable

from streamwarden.core.dialects import asks_for_stream
from streamwarden.core.refusals import RefusalKind
from streamwarden.middleware._asgi import Message, Scope, Send, send_refusal
from streamwarden.middleware.inbox import Inbox
from streamwarden.middleware.streams import Streams
from streamwarden.observation.register import NO_SLOT, Slot

__all__ = ["Admission"]

# Bytes of one body message kept to find '"stream": true' split across two messages.
_SEAM = 64


class Admission:
    """One request's stream question and its ``max_concurrent_streams`` slot."""

    __slots__ = (
        "_body_seam",
        "_inbox",
        "_on_stream_asked",
        "_scope",
        "_slot",
        "_streams",
        "asks_for_stream",
    )

    def __init__(self, streams: Streams, scope: Scope, inbox: Inbox) -> None:
        self._streams = streams
        self._scope = scope
        self._inbox = inbox
        self._on_stream_asked: Callable[[], None] | None = None
        self._body_seam = b""
        self._slot: Slot = NO_SLOT
        #: The request asks for a stream (as far as its body has been seen).
        self.asks_for_stream = False

    def look_at_request(self, on_stream_asked: Callable[[], None]) -> None:
        """Look at the headers and query now, and at the body as it is read.

        ``on_stream_asked`` is called once the request is known to ask for a
        stream and has no more body to read: at once for a bodiless request.
        """
        accept: str | None = None
        # Over HTTP/2 and 3 a body needs no Content-Length: assume there is one.
        has_body = self._scope.get("http_version") not in ("1.0", "1.1")
        for name, value in self._scope.get("headers") or ():
            name = name.lower()
            if name == b"accept":
                accept = value.decode("latin-1")
            elif name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                has_body = True
        query = self._scope.get("query_string", b"").decode("latin-1")
        self.asks_for_stream = asks_for_stream(accept, query, b"")
        if not has_body:
            if self.asks_for_stream:
                on_stream_asked()
            return
        self._on_stream_asked = on_stream_asked
        self._inbox.on_request = self._look_at_body

    def stop_looking(self) -> None:
        """The response has started: what the body still says no longer matters."""
        self._inbox.on_request = None
        self._on_stream_asked = None

    def _look_at_body(self, message: Message) -> None:
        """Each request body message the app receives, until the last one."""
        body: bytes = bytes(message.get("body", b""))
        if body and not self.asks_for_stream:
            self.asks_for_stream = asks_for_stream(
                None, "", self._body_seam + body[:_SEAM]
            ) or asks_for_stream(None, "", body)
            self._body_seam = body[-_SEAM:]
        if not message.get("more_body", False):
            self._inbox.on_request = None
            if self.asks_for_stream and self._on_stream_asked is not None:
                self._on_stream_asked()

    # -- max_concurrent_streams --------------------------------------------------

    async def admit(self, limit: int, send: Send) -> bool:
        """Take a stream slot if the request asks for a stream; False if refused.

        With no ``limit`` every request is admitted without a slot, and so is
        a request that asks for no stream. A refused request has had its
        ``503`` sent; the app must not run.
        """
        if not limit:
            return True
        inbox = self._inbox
        if not self.asks_for_stream and inbox.on_request is not None:
            first = await inbox.receive()  # _look_at_body sees it on the way
            if first.get("type") == "http.request":
                inbox.hold(first)
        if not self.asks_for_stream:
            return True
        slot = self._streams.admit(limit)
        if slot is None:
            await inbox.stop()  # a watch started once the body was read, if any
            await send_refusal(send, RefusalKind.TOO_MANY_STREAMS, limit=limit)
            return False
        self._slot = slot
        return True

    def release(self) -> None:
        """Give the slot back, if one was taken; later calls do nothing."""
        self._slot.release()
