"""Whether a request asks for a stream, and whether it gets one of ``max_concurrent_streams``.

A request asks for a stream by the rule the sidecar uses
(:func:`~streamwarden.core.dialects.asks_for_stream`): ``Accept:
text/event-stream``, ``alt=sse``, or ``"stream": true`` in its body. The
pipeline's request step reads the headers and query (and, to decide on a
slot, the first body message); the body is then looked at as it goes by,
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
  the app runs (the request step's), or is refused with ``503`` and
  ``Retry-After`` and the app never runs. To see ``"stream": true`` in
  time, the step reads the first body message before the app
  (:class:`~streamwarden.middleware.resume.FirstMessage`), and hands it
  back as its first ``receive()``. The responder gives the slot back when the response
  starts as something other than a stream, or as the stream's last bytes
  leave (or its client is gone), and at the latest when the app returns.
"""

from __future__ import annotations

from collections.abc import Callable

from streamwarden.core.dialects import asks_for_stream
from streamwarden.middleware._asgi import Message, Scope
from streamwarden.middleware.inbox import Inbox
from streamwarden.middleware.resume import has_body
from streamwarden.observation.register import NO_SLOT, Slot
from streamwarden.pipeline.request import Forward

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
        "asks_for_stream",
    )

    def __init__(self, scope: Scope, inbox: Inbox) -> None:
        self._scope = scope
        self._inbox = inbox
        self._on_stream_asked: Callable[[], None] | None = None
        self._body_seam = b""
        self._slot: Slot = NO_SLOT
        #: The request asks for a stream (as far as its body has been seen).
        self.asks_for_stream = False

    def look_at_request(
        self, on_stream_asked: Callable[[], None], forward: Forward, first: Message | None
    ) -> None:
        """Take what the request step saw (``forward``), and look at the body as it is read.

        ``first``: the body message the step read, held for the app, if any.
        ``on_stream_asked`` is called once the request is known to ask for a
        stream and has no more body to read: at once for a bodiless request.
        """
        self._slot = forward.slot
        self.asks_for_stream = forward.asks_for_stream
        if not has_body(self._scope):
            if self.asks_for_stream:
                on_stream_asked()
            return
        self._on_stream_asked = on_stream_asked
        self._inbox.on_request = self._look_at_body
        if first is not None:  # held for the app: it passes no hook on its way
            self._look_at_body(first)

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

    def release(self) -> None:
        """Give the slot back, if one was taken; later calls do nothing."""
        self._slot.release()
