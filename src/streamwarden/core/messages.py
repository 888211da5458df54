"""A WebSocket session whose messages carry streams (the Responses API's), with no I/O.

Over the Responses API's WebSocket the client sends ``response.create``
and the server answers with the events of the SSE version, one per text
message, ending with ``response.completed``, ``.failed`` or ``.incomplete``.
Each ``response.create`` is one stream here: its own
:class:`~streamwarden.core.relay.Relay` (opened by the face, through its
pipeline, so it is metered, limited and recorded like any stream), fed
each upstream message of its response as one whole event
(its framing is ``messages``: :class:`~streamwarden.core.sse.MessageFramer`): the dialect, the
books, the limits and the tool-call checks are the relay's, not repeated
here.

What a face does with each input is this model's answer:

- a client message always goes on as it came (a ``response.create`` also
  opens a stream);
- an upstream message goes on as it came, unless its stream's relay ends
  the stream on it: then the client gets the relay's ``error`` message and
  the session ends with an error close (:data:`CUT_CLOSE_CODE`): the openai
  SDK reads a 1000 or 1001 close as a normal end of its event loop, and
  raises on any other;
- the upstream closing (any code, 1000 included) while a response is open
  is a truncation, and vanishing without a close frame (1006) an upstream
  error: both reach the client as an ``error`` message and an error close,
  never as a normal close;
- the client leaving ends every open stream ``client_cancelled`` (a
  session's streams end with it: the face closes the upstream at once).

Responses in one session are one after the other, or in lanes: a
``response.create`` may name a ``stream_id``, whose events echo it, and
each lane is first in, first out. A queued response's stream opens when
its lane reaches it (its clock counts from its request all the same).
Messages that are no response's (none open in their lane) go on untouched.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from streamwarden.core.dialects import detect
from streamwarden.core.dialects.base import load_json
from streamwarden.core.endings import ErrorCode
from streamwarden.core.lifecycle import Gone
from streamwarden.core.relay import Relay
from streamwarden.core.sse import SSEDecoder

__all__ = [
    "CUT_CLOSE_CODE",
    "FORWARD",
    "MAX_TRACKED",
    "MessageSession",
    "Reply",
    "Upstream",
    "carries_streams",
    "error_message",
]

#: The close code of a session whose stream was cut: 1011 (internal error),
#: which clients raise on (the ``websockets`` library, and so the openai SDK,
#: treat only 1000 and 1001 as a normal end).
CUT_CLOSE_CODE = 1011
#: Close codes a client reads as a normal end.
_NORMAL_CLOSE = (1000, 1001)

#: Responses a session keeps books on at once (open and queued); more are
#: relayed as they come, unmetered: the books stay bounded whatever a client sends.
MAX_TRACKED = 64

#: Opens one response's stream: ``(started_at, now)`` -> its relay.
Opener = Callable[[float, float], Relay]
#: The stream is over, and nothing more of it will come: record it.
Finisher = Callable[[Relay, float], None]

_CREATE = "response.create"


@dataclass(frozen=True, slots=True)
class Reply:
    """What the face does with one upstream message."""

    #: The message goes to the client as it came.
    forward: bool
    #: Then this ``error`` message, an error close, and the session ends (``None``: goes on).
    error: str | None = None


#: The answer for most messages: on they go.
FORWARD = Reply(True)
_DROP = Reply(False)


@dataclass(frozen=True, slots=True)
class Upstream:
    """How the session ends on the client's side after the upstream closed."""

    #: The ``error`` message to send first (``None``: none).
    error: str | None
    #: The close code for the client.
    code: int


def carries_streams(setting: str, path: str) -> bool:
    """Whether a WebSocket on ``path`` carries streams (the Responses API's), by the dialect
    setting and detection (:func:`~streamwarden.core.dialects.detect`): others are only relayed."""
    found = detect(setting, path=path, content_type=None, headers={}, framing="messages")
    return found.dialect.name != "generic"


class _Lane:
    """The responses of one lane: the one being answered, and those queued behind it."""

    __slots__ = ("active", "queued")

    def __init__(self) -> None:
        self.active: Relay | None = None
        #: When each queued ``response.create`` arrived.
        self.queued: deque[float] = deque()


class MessageSession:
    """One WebSocket session's streams, as the face feeds it the session's messages."""

    __slots__ = ("_finish", "_gone", "_lanes", "_open", "_tracked", "cut")

    def __init__(self, open_stream: Opener, finish_stream: Finisher) -> None:
        self._open = open_stream
        self._finish = finish_stream
        self._lanes: dict[str | None, _Lane] = {}
        self._tracked = 0
        #: Streams ended by the client leaving: recorded at the session's end,
        #: after what the upstream still sent was metered as zombie tokens.
        self._gone: list[Relay] = []
        #: A stream was cut: the session is over.
        self.cut = False

    # -- state ---------------------------------------------------------------

    @property
    def streams(self) -> list[Relay]:
        """The open streams, one per lane being answered."""
        return [lane.active for lane in self._lanes.values() if lane.active is not None]

    @property
    def deadline(self) -> float | None:
        """When :meth:`poll` must be called next (``None``: no timer runs)."""
        deadlines = [d for relay in self.streams if (d := relay.deadline) is not None]
        return min(deadlines) if deadlines else None

    # -- inputs --------------------------------------------------------------

    def client_message(self, data: str, now: float) -> bool:
        """A client text message (it goes on as it came); True if it opened a stream."""
        if _CREATE not in data or self.cut:
            return False
        message = load_json(data)
        if not isinstance(message, dict) or message.get("type") != _CREATE:
            return False
        if self._tracked >= MAX_TRACKED:
            return False
        lane_id = message.get("stream_id")
        lane = self._lanes.setdefault(lane_id if isinstance(lane_id, str) else None, _Lane())
        self._tracked += 1
        if lane.active is None:
            lane.active = self._start(now, now)
            return True
        lane.queued.append(now)
        return False

    def upstream_message(self, data: str, now: float) -> Reply:
        """An upstream text message: what the face does with it."""
        if not self._lanes:
            return FORWARD  # no response open: nothing to read
        lane_id = _lane_of(data) if '"stream_id"' in data else None
        lane = self._lanes.get(lane_id)
        relay = lane.active if lane is not None else None
        if relay is None:
            return FORWARD
        assert lane is not None
        raw = data.encode()
        sent = relay.meter.events_out
        written = relay.feed(raw, now)  # one whole message: one frame (MessageFramer)
        # What the relay wrote: the message itself when it went on, then its ending.
        forward = relay.meter.events_out > sent
        ending = written[len(raw) :] if forward else written
        if ending:
            self.cut = True
            return Reply(forward, error_message(ending))
        if relay.done:  # the client left: counted, never sent
            return _DROP
        if relay.terminal_seen or relay.meter.upstream_reported_error:
            # Its answer is whole, or the upstream said it failed (its own
            # ``error`` went on): the stream ends as an HTTP one ends there.
            relay.upstream_eof(now)
            self._next(lane, lane_id, now)
        return FORWARD if forward else _DROP

    def upstream_too_large(self, now: float) -> str | None:
        """The transport refused an upstream message over ``max_event_bytes``."""
        return self._cut_all(lambda relay: relay.upstream_refused(now, ErrorCode.EVENT_TOO_LARGE))

    def upstream_closed(self, code: int | None, now: float) -> Upstream:
        """The upstream closed with ``code`` (``None``: it vanished without a close frame)."""
        if code is None:
            error = self._cut_all(lambda relay: relay.upstream_failed(now))
        else:
            error = self._cut_all(lambda relay: relay.upstream_eof(now))
        if error is not None:
            # An upstream's own error code stays; a normal one would hide the cut.
            if code is None or code in _NORMAL_CLOSE:
                code = CUT_CLOSE_CODE
            return Upstream(error, code)
        if code is None:  # vanished between responses: still no normal end
            return Upstream(None, CUT_CLOSE_CODE)
        return Upstream(None, code)

    def client_closed(self, now: float) -> None:
        """The client closed or vanished: every open stream ends with it."""
        for relay in self.streams:
            relay.client_gone(now)
            self._gone.append(relay)
        for lane in self._lanes.values():
            lane.queued.clear()

    def poll(self, now: float) -> str | None:
        """Run the open streams' timers; the ``error`` message of one that cut its stream."""
        return self._cut_all(lambda relay: relay.poll(now))

    def end(self, now: float) -> None:
        """The session is over: record every stream it still has (open ones end cancelled)."""
        relays = self._gone + self.streams
        self._gone = []
        self._lanes.clear()
        for relay in dict.fromkeys(relays):
            self._finish(relay, now)

    # -- internals -----------------------------------------------------------

    def _start(self, started_at: float, now: float) -> Relay:
        relay = self._open(started_at, now)
        # A session's streams end with it: nothing reads a closed session on.
        relay.lifecycle.gone = Gone.CANCEL
        return relay

    def _next(self, lane: _Lane, lane_id: str | None, now: float) -> None:
        """The lane's stream ended: record it, and open the next one queued."""
        relay = lane.active
        assert relay is not None
        self._finish(relay, now)
        self._tracked -= 1
        lane.active = self._start(lane.queued.popleft(), now) if lane.queued else None
        if lane.active is None:
            del self._lanes[lane_id]

    def _cut_all(self, act: Callable[[Relay], bytes]) -> str | None:
        """Put an input to every open stream; the first error message it wrote (the one sent)."""
        first: str | None = None
        for relay in self.streams:
            written = act(relay)
            if written and first is None:
                first = error_message(written)
                self.cut = True
        return first


def error_message(event: bytes) -> str:
    """The ``error`` message of a stream the relay ended: its error event's data.

    A message is one event's data, so the error's shape stays the dialect's
    alone (:meth:`~streamwarden.core.dialects.Dialect.error_event`): for the
    Responses API it is what the openai SDK parses as ``ResponseWsError``
    (``type: "error"`` and an ``error`` object with ``code`` and ``message``).
    """
    events = SSEDecoder().feed(event)
    return events[0].data if events else ""


def _lane_of(data: str) -> str | None:
    """The lane an upstream message names (its ``stream_id``), if any."""
    message = load_json(data)
    lane = message.get("stream_id") if isinstance(message, dict) else None
    return lane if isinstance(lane, str) else None
