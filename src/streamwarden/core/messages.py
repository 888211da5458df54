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

- a client message goes on as it came (a ``response.create`` also opens a
  stream), unless the face has no stream place for it
  (``max_concurrent_streams``: the session's ``admit``): then that
  ``response.create`` goes nowhere, the client gets an ``error`` message
  refusing it, and the session goes on;
- an upstream message goes on as it came, unless its stream's relay ends
  the stream on it: then the client gets the relay's ``error`` message and
  the session ends with an error close (:data:`CUT_CLOSE_CODE`): the openai
  SDK reads a 1000 or 1001 close as a normal end of its event loop, and
  raises on any other;
- on a stream with transforms (output filters) what leaves them goes in the
  message's place (:attr:`Reply.messages`: nothing while the hold-back
  waits, a redacted message rewritten, a ``block`` a cut with
  ``content_blocked``), and on a cut by a close or a timer what they still
  held goes before its ``error`` message (:meth:`MessageSession.take_released`);
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

from streamwarden.core.dialects import Dialect, Observation, detect
from streamwarden.core.dialects.base import dump_json, load_json
from streamwarden.core.endings import ErrorCode
from streamwarden.core.lifecycle import Gone
from streamwarden.core.refusals import RefusalKind
from streamwarden.core.relay import Relay
from streamwarden.core.sse import Frame, SSEDecoder
from streamwarden.core.transform import Passing, Stop, TransformChain

__all__ = [
    "CUT_CLOSE_CODE",
    "FORWARD",
    "MAX_TRACKED",
    "MessageSession",
    "Reply",
    "Upstream",
    "carries_streams",
    "error_message",
    "refusal_message",
]

#: The close code of a session whose stream was cut: 1011 (internal error),
#: which clients raise on (the ``websockets`` library, and so the openai SDK,
#: treat only 1000 and 1001 as a normal end).
CUT_CLOSE_CODE = 1011
#: Close codes a client reads as a normal end.
_NORMAL_CLOSE = (1000, 1001)

#: Responses a session keeps books on at once (open and queued); one more is
#: refused with an ``error`` message (``too_many_streams``), never forwarded
#: unread: the books stay bounded whatever a client sends, and no response
#: goes past the filters and the limits.
MAX_TRACKED = 64

#: Opens one response's stream: ``(started_at, now)`` -> its relay.
Opener = Callable[[float, float], Relay]
#: The stream is over, and nothing more of it will come: record it.
Finisher = Callable[[Relay, float], None]
#: A place for one more stream (``max_concurrent_streams``): ``None`` if
#: taken (the face gives it back when that stream is recorded, or at the
#: session's end for one never opened), else the ``error`` message refusing it.
Admitter = Callable[[], str | None]

_CREATE = "response.create"


@dataclass(frozen=True, slots=True)
class Reply:
    """What the face does with one upstream message."""

    #: The message goes to the client as it came.
    forward: bool
    #: Then this ``error`` message, an error close, and the session ends (``None``: goes on).
    error: str | None = None
    #: These go to the client in the message's place (after it, with ``forward``):
    #: what its stream's transforms let out (the output filters' hold-back).
    messages: tuple[str, ...] = ()
    #: A client message that goes nowhere: this goes back to the client, and the session
    #: goes on (a ``response.create`` refused).
    answer: str | None = None
    #: A client message opened a stream: its timers run from now.
    opened: bool = False


#: The answer for most messages: on they go.
FORWARD = Reply(True)
_DROP = Reply(False)
_OPENED = Reply(True, opened=True)


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


def refusal_message(setting: str, path: str, code: str, message: str) -> str:
    """The ``error`` message refusing a response on ``path`` (a face's refusal, e.g. no stream
    place left), in the shape of its dialect's error event."""
    found = detect(setting, path=path, content_type=None, headers={}, framing="messages")
    return error_message(found.dialect.error_event(code, f"streamwarden: {message}"))


class _Sent:
    """The last transform of a stream that has any: the messages that leave them, as they go.

    Where transforms act (output filters) a message may wait, go on
    rewritten, or be let go with others later: what the client gets is
    what leaves the chain, one message per frame (a rewritten frame's bytes
    are its data: :func:`~streamwarden.core.sse.with_data`), then the
    stream's ``error`` message if it ended with one.
    """

    __slots__ = ("error", "messages", "stop")

    def __init__(self) -> None:
        self.stop: Stop | None = None
        self.messages: list[str] = []
        self.error: bytes | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        self.messages.append(frame.raw.decode("utf-8", "replace"))
        out.append((frame, seen))

    def close(self, now: float, out: list[Passing]) -> None:
        return None

    def ending(self, error: bytes) -> bytes:
        self.error = error
        return error

    def take(self) -> tuple[tuple[str, ...], str | None]:
        """The messages let out since the last take, and the ``error`` message (if it ended)."""
        messages, self.messages = tuple(self.messages), []
        error, self.error = self.error, None
        return messages, error_message(error) if error is not None else None


class _Lane:
    """The responses of one lane: the one being answered, and those queued behind it."""

    __slots__ = ("active", "queued")

    def __init__(self) -> None:
        self.active: Relay | None = None
        #: When each queued ``response.create`` arrived.
        self.queued: deque[float] = deque()


class MessageSession:
    """One WebSocket session's streams, as the face feeds it the session's messages."""

    __slots__ = (
        "_admit",
        "_finish",
        "_gone",
        "_lanes",
        "_open",
        "_released",
        "_rules",
        "_sent",
        "_tracked",
        "cut",
    )

    def __init__(
        self, open_stream: Opener, finish_stream: Finisher, admit: Admitter | None = None
    ) -> None:
        self._open = open_stream
        self._finish = finish_stream
        self._admit = admit
        #: The streams with transforms: what leaves them, message by message.
        self._sent: dict[Relay, _Sent] = {}
        #: What their transforms let go on a cut (by a close, a timer): sent before its error.
        self._released: list[str] = []
        self._lanes: dict[str | None, _Lane] = {}
        self._tracked = 0
        #: The dialect of the streams (the last one opened), for the session's own refusals.
        self._rules: Dialect | None = None
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
        """A client text message (see :meth:`client_reply`); True if it opened a stream."""
        return self.client_reply(data, now).opened

    def client_reply(self, data: str, now: float) -> Reply:
        """A client text message: whether it goes on (a refused ``response.create``: its answer)."""
        if _CREATE not in data or self.cut:
            return FORWARD
        message = load_json(data)
        if not isinstance(message, dict) or message.get("type") != _CREATE:
            return FORWARD
        lane_id = message.get("stream_id")
        lane_id = lane_id if isinstance(lane_id, str) else None
        if self._tracked >= MAX_TRACKED:
            # Refused, never forwarded past the books: an untracked response
            # would go unfiltered, unlimited and unmetered.
            return Reply(False, answer=_in_lane(self._over_books(), lane_id))
        if self._admit is not None:
            refused = self._admit()
            if refused is not None:
                return Reply(False, answer=_in_lane(refused, lane_id))
        lane = self._lanes.setdefault(lane_id, _Lane())
        self._tracked += 1
        if lane.active is None:
            lane.active = self._start(now, now)
            return _OPENED
        lane.queued.append(now)
        return FORWARD

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
        transformed = self._sent.get(relay)
        messages: tuple[str, ...] = ()
        if transformed is None:
            # What the relay wrote: the message itself when it went on, then its ending.
            forward = relay.meter.events_out > sent
            ending = written[len(raw) :] if forward else written
            error = error_message(ending) if ending else None
        else:  # what left its transforms goes in its place
            forward = False
            messages, error = transformed.take()
        if error is not None:
            self.cut = True
            return Reply(forward, error, messages)
        if relay.done:  # the client left: counted, never sent
            return _DROP
        if relay.terminal_seen or relay.meter.upstream_reported_error:
            # Its answer is whole, or the upstream said it failed (its own
            # ``error`` went on): the stream ends as an HTTP one ends there.
            relay.upstream_eof(now)
            if transformed is not None:  # what still waited goes out (or a block ends it)
                more, error = transformed.take()
                messages += more
                if error is not None:
                    self.cut = True
                    return Reply(False, error, messages)
            self._next(lane, lane_id, now)
        if transformed is not None:
            return Reply(False, messages=messages) if messages else _DROP
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

    def take_released(self) -> list[str]:
        """What streams' transforms let go as a cut ended them: the face sends these first,
        then the cut's ``error`` message (:meth:`upstream_closed`, :meth:`poll`, ...)."""
        released, self._released = self._released, []
        return released

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
        self._sent.clear()
        for relay in dict.fromkeys(relays):
            self._finish(relay, now)

    # -- internals -----------------------------------------------------------

    def _start(self, started_at: float, now: float) -> Relay:
        relay = self._open(started_at, now)
        self._rules = relay.rules
        # A session's streams end with it: nothing reads a closed session on.
        relay.lifecycle.gone = Gone.CANCEL
        chain = relay.chain
        if chain is not None:  # a plain stream's messages go on as they came, at no cost
            sent = _Sent()
            relay.chain = TransformChain((*chain.transforms, sent), relay.meter)
            self._sent[relay] = sent
        return relay

    def _over_books(self) -> str:
        """The ``error`` message refusing a response past :data:`MAX_TRACKED`, in the streams'
        dialect (written by the last one opened: at that many, one was)."""
        rules = self._rules
        assert rules is not None
        refused = RefusalKind.TOO_MANY_STREAMS.refusal
        message = f"a session holds at most {MAX_TRACKED} responses at once"
        return error_message(rules.error_event(refused.code, f"streamwarden: {message}"))

    def _next(self, lane: _Lane, lane_id: str | None, now: float) -> None:
        """The lane's stream ended: record it, and open the next one queued."""
        relay = lane.active
        assert relay is not None
        self._finish(relay, now)
        self._sent.pop(relay, None)
        self._tracked -= 1
        lane.active = self._start(lane.queued.popleft(), now) if lane.queued else None
        if lane.active is None:
            del self._lanes[lane_id]

    def _cut_all(self, act: Callable[[Relay], bytes]) -> str | None:
        """Put an input to every open stream; the first error message it wrote (the one sent)."""
        first: str | None = None
        for relay in self.streams:
            written = act(relay)
            transformed = self._sent.get(relay)
            if transformed is None:
                error = error_message(written) if written else None
            else:  # what its transforms held goes first
                released, error = transformed.take()
                self._released += released
            if error is not None and first is None:
                first = error
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


def _in_lane(message: str, lane: str | None) -> str:
    """A message of the session's own, in the lane of the response it is about."""
    if lane is None:
        return message
    loaded = load_json(message)
    if not isinstance(loaded, dict):
        return message
    return dump_json({**loaded, "stream_id": lane})


def _lane_of(data: str) -> str | None:
    """The lane an upstream message names (its ``stream_id``), if any."""
    message = load_json(data)
    lane = message.get("stream_id") if isinstance(message, dict) else None
    return lane if isinstance(lane, str) else None
