"""One request through the middleware: the ASGI twin of the sidecar's relay loop.

A :class:`StreamResponder` wraps the app's ``send`` and ``receive`` for one
HTTP request. It decides at ``http.response.start`` whether the response is
a stream, by the same rule as the sidecar
(:func:`~streamwarden.dialects.stream_framing`); every other response is
handed to the server message by message, untouched.

For a stream it moves bytes and time through a core
:class:`~streamwarden.relay.Relay`, like the sidecar does:

- the app's body chunks are fed to the relay and only what it returns is
  sent, so a partial event is held back until its last byte arrives;
- a timer task calls ``relay.poll`` at ``relay.deadline`` (keep-alives,
  ``upstream_idle_timeout``, ``max_stream_duration``);
- every write to the server (app body, keep-alive, error event, end of
  body) happens under one lock, so two sends never overlap and the bytes
  leave in the order the relay produced them;
- the :class:`~streamwarden.middleware.inbox.Inbox` watches for
  ``http.disconnect``; the app's "upstream" is the app itself, so closing
  it means cancelling the app's task, which runs its generator's
  ``finally`` (where the app closes its provider stream) at once.

Before the response. An app usually awaits its provider's response headers
(the whole prefill, seconds for a long prompt) before it starts its own
stream. A request that asks for a stream (by the rule the sidecar uses:
``Accept: text/event-stream``, ``alt=sse``, or ``"stream": true`` in the
body, which the responder looks for as the app reads it) is watched from
the moment the app has read its whole body, or from the start if it has
none; a client that leaves before the response starts gets the app
cancelled, so the app's provider request is closed at once, as the sidecar
closes its upstream request. Such a request ends without a stream record,
as in the sidecar. Other requests are never watched before their
response: cancelling them could cut an app's work short, and watching
would cost each of them a task.

Cancelling the app. The app runs in the server's own task: spawning a task
per request only for the few that turn out to be streams would tax every
request. So the middleware cancels that task, the way ``asyncio.timeout``
does, and takes its cancellation back (``Task.uncancel``) when the
``CancelledError`` comes out of the app. It only ever cancels from another
task or a loop callback, never from inside the task itself, and only while
the app is running, so the ``CancelledError`` always lands inside the app.

How a stream ends (one end state each, recorded by the relay):

- the app finishes its body: ``completed``, or ``stream_truncated`` with the
  dialect's error event if a known dialect's terminal event is missing;
- the app raises after the response started: ``upstream_error`` with the
  error event and a clean end of body; the exception is logged with its
  traceback and not re-raised (before the response started, exceptions
  propagate untouched);
- the client disconnects: ``client_cancelled``, the app is cancelled
  (before the response started: no stream, the app is cancelled, and the
  request ends quietly);
- a timer or limit fires: the error event, a clean end, the app cancelled;
- the client stops reading for ``client_write_timeout``: ``client_too_slow``,
  the app is cancelled and the response is left unfinished, so the server
  drops the connection;
- the server cancels the request (a shutdown): ``shutting_down``, then the
  cancellation goes on up.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.dialects import asks_for_stream, stream_framing
from streamwarden.headers import drop_hop_by_hop, stream_response_headers
from streamwarden.meter import GapObserver, StreamRecord
from streamwarden.middleware._asgi import ASGIApp, Message, Receive, Scope, Send
from streamwarden.middleware.inbox import Inbox
from streamwarden.relay import Relay, refusal_body

__all__ = ["FaceContext", "StreamResponder", "Streams"]

log = logging.getLogger("streamwarden.middleware")

# Statuses that never carry a body, so never a stream.
_NO_BODY = frozenset({204, 304})
# Bytes of one body chunk kept to find '"stream": true' split across two chunks.
_SEAM = 64
# Bytes an app may send after its stream ended without waiting once: beyond
# them its send() yields, so that a pending stop can land in an app that
# awaits nothing else.
_ZOMBIE_BURST = 1 << 20

Listener = Callable[[StreamRecord], None]


class Streams:
    """The middleware's register of streams: how many are in flight, the recently finished."""

    def __init__(self, keep: int = 1000) -> None:
        self.active = 0
        #: Requests that asked for a stream and are running (max_concurrent_streams).
        self.admitted = 0
        self.finished: deque[StreamRecord] = deque(maxlen=keep)
        #: Called with each finished stream's record, exactly once per stream.
        self.listeners: list[Listener] = []
        self._ids = itertools.count(1)

    def open(self) -> str:
        self.active += 1
        return f"{next(self._ids):x}"

    def close(self, record: StreamRecord) -> None:
        self.active -= 1
        self.finished.append(record)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("a stream listener failed")


@dataclass(frozen=True, slots=True)
class FaceContext:
    """What every request of one middleware instance shares."""

    settings: Settings
    streams: Streams
    gap_observer: GapObserver | None = None
    #: ``settings.stream_media_types``, lower-cased, for the stream check.
    extra_media_types: frozenset[str] = field(default=frozenset())


class _Phase(enum.Enum):
    WAITING = "waiting"  # no http.response.start yet
    PASSING = "passing"  # not a stream: messages go to the server untouched
    STREAMING = "streaming"  # a stream, relayed


class StreamResponder:
    """One HTTP request through the middleware; a fresh one per request."""

    __slots__ = (
        "_app_closed",
        "_app_running",
        "_asks_for_stream",
        "_base_cancelling",
        "_body_closed",
        "_body_seam",
        "_cancel_requested",
        "_client_gone",
        "_context",
        "_gone_at",
        "_inbox",
        "_lock",
        "_loop",
        "_phase",
        "_relay",
        "_route",
        "_scope",
        "_server_send",
        "_started_at",
        "_status",
        "_stream_id",
        "_task",
        "_timer",
        "_unyielded",
        "_watching_early",
    )

    def __init__(self, context: FaceContext, scope: Scope, receive: Receive, send: Send) -> None:
        self._context = context
        self._scope = scope
        self._server_send = send
        self._inbox = Inbox(receive)
        self._loop = asyncio.get_running_loop()
        #: When the request arrived: the stream's TTFT and duration count from here.
        self._started_at = self._loop.time()
        self._phase = _Phase.WAITING
        self._task: asyncio.Task[Any] | None = None
        self._base_cancelling = 0
        self._app_running = False
        self._cancel_requested = False
        # Stream state, set when a stream starts.
        self._relay: Relay | None = None
        self._route: ResolvedRoute | None = None
        self._status = 200
        self._stream_id = ""
        self._lock: asyncio.Lock | None = None
        self._timer: asyncio.Task[None] | None = None
        #: No more writes to the client: the body ended, or the client is gone.
        self._body_closed = False
        #: The app sent its last body message (``more_body`` false).
        self._app_closed = False
        self._client_gone = False
        self._gone_at: float | None = None
        #: Bytes the app sent after the stream ended since its send() last yielded.
        self._unyielded = 0
        # Watching for a disconnect before the response (see the module docstring).
        self._watching_early = False
        self._asks_for_stream = False
        self._body_seam = b""

    # -- the request ---------------------------------------------------------

    async def run(self, app: ASGIApp) -> None:
        """Run the app for this request; return or raise as the app would have."""
        self._look_at_request()
        limit = self._context.settings.max_concurrent_streams
        if not limit:
            await self._run(app)
            return
        admitted = await self._admit(limit)
        if admitted is False:
            return
        try:
            await self._run(app)
        finally:
            if admitted:
                self._context.streams.admitted -= 1

    async def _admit(self, limit: int) -> bool | None:
        """Take a stream slot: ``None`` if the request asks for no stream, ``False`` if refused.

        As in the sidecar, a request asks for a stream by its ``Accept``
        header, ``alt=sse``, or ``"stream": true`` in the first part of its
        body, which is read here, before the app runs, and handed to the app
        as its first ``receive()``. A refused request gets ``503`` with
        ``Retry-After`` and the app never runs.
        """
        inbox = self._inbox
        if not self._asks_for_stream and inbox.on_request is not None:
            first = await inbox.receive()  # _look_at_body sees it on the way
            if first.get("type") == "http.request":
                inbox.hold(first)
        if not self._asks_for_stream:
            return None
        streams = self._context.streams
        if streams.admitted >= limit:
            await inbox.stop()  # a watch started by _look_at_body, if any
            body = refusal_body("too_many_streams", f"{limit} streams are open")
            await self._server_send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(body)),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await self._server_send({"type": "http.response.body", "body": body})
            return False
        streams.admitted += 1
        return True

    async def _run(self, app: ASGIApp) -> None:
        task = asyncio.current_task()
        self._task = task
        self._base_cancelling = task.cancelling() if task is not None else 0
        self._app_running = True
        error: BaseException | None = None
        try:
            await app(self._scope, self._inbox.receive, self._send)
        except BaseException as exc:
            if self._phase is not _Phase.STREAMING:
                if await self._end_unstreamed(exc):
                    return
                raise  # not a stream: the server handles it as usual
            error = exc
        finally:
            self._app_running = False
        if self._phase is not _Phase.STREAMING:
            if self._watching_early:
                await self._end_unstreamed(None)
            return
        cancelled_from_outside = isinstance(error, asyncio.CancelledError)
        if self._cancel_requested and task is not None:
            # Take back our own cancellation; anything left is someone else's.
            cancelled_from_outside = task.uncancel() > self._base_cancelling
        if await self._end(error, cancelled_from_outside) and error is not None:
            raise error

    async def _send(self, message: Message) -> None:
        """The ``send()`` handed to the app."""
        phase = self._phase
        if phase is _Phase.PASSING:
            await self._server_send(message)
        elif phase is _Phase.STREAMING:
            await self._send_streamed(message)
        elif message["type"] == "http.response.start":
            headers = self._stream_headers(message)
            if headers is None:
                self._phase = _Phase.PASSING
                await self._server_send(message)
            else:
                await self._start_stream(message, headers)
        else:
            await self._server_send(message)

    # -- before the response -------------------------------------------------

    def _look_at_request(self) -> None:
        """Watch at once a bodiless request that asks for a stream; else look at its body."""
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
        self._asks_for_stream = asks_for_stream(accept, query, b"")
        if not has_body:
            if self._asks_for_stream:
                self._watch_early()
            return
        self._inbox.on_request = self._look_at_body

    def _look_at_body(self, message: Message) -> None:
        """Each request body message the app receives, until the last one."""
        body: bytes = bytes(message.get("body", b""))
        if body and not self._asks_for_stream:
            self._asks_for_stream = asks_for_stream(
                None, "", self._body_seam + body[:_SEAM]
            ) or asks_for_stream(None, "", body)
            self._body_seam = body[-_SEAM:]
        if not message.get("more_body", False):
            self._inbox.on_request = None
            if self._asks_for_stream and self._phase is _Phase.WAITING:
                self._watch_early()

    def _watch_early(self) -> None:
        self._watching_early = True
        self._inbox.watch(self._client_left_before_start)

    def _client_left_before_start(self) -> None:
        """The client left while the app was still preparing its response."""
        if self._phase is _Phase.WAITING:
            self._stop_app()

    async def _end_unstreamed(self, error: BaseException | None) -> bool:
        """Clean up after a request that never streamed; True if ``error`` was our own cancel."""
        if not self._watching_early:
            return False
        await self._inbox.stop()
        task = self._task
        if not self._cancel_requested or task is None:
            return False
        # Take back our own cancellation; anything left is someone else's.
        ours = task.uncancel() <= self._base_cancelling
        return ours and isinstance(error, asyncio.CancelledError)

    # -- the start -----------------------------------------------------------

    def _stream_headers(self, message: Message) -> dict[str, str] | None:
        """The response's headers (lower-case names) if it is a stream to relay, else None."""
        if message.get("trailers") or self._scope.get("method") == "HEAD":
            return None
        if message.get("status", 200) in _NO_BODY:
            return None
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in message.get("headers") or ()
        }
        framing = stream_framing(
            headers.get("content-type"), headers, self._context.extra_media_types
        )
        if framing is None:
            return None
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            # A compressed stream cannot be framed; it is passed on as is.
            return None
        return headers

    async def _start_stream(self, message: Message, headers: Mapping[str, str]) -> None:
        context = self._context
        path: str = self._scope.get("path") or "/"
        route = context.settings.for_path(path)
        loop = self._loop
        relay = Relay(
            route.limits,
            started_at=self._started_at,
            now=loop.time(),
            path=path,
            content_type=headers.get("content-type"),
            headers=headers,
            dialect=route.dialect,
            gap_observer=context.gap_observer,
        )
        self._phase = _Phase.STREAMING
        self._inbox.on_request = None
        self._relay = relay
        self._route = route
        self._status = int(message.get("status", 200))
        self._lock = asyncio.Lock()
        self._stream_id = context.streams.open()
        start = dict(message)
        start["headers"] = _encode(stream_response_headers(drop_hop_by_hop(_decode(message))))
        try:
            await self._server_send(start)
        except OSError:
            self._client_left()
            raise
        self._inbox.watch(self._client_disconnected)
        self._timer = loop.create_task(self._keep_time())

    # -- the body ------------------------------------------------------------

    async def _send_streamed(self, message: Message) -> None:
        assert self._relay is not None and self._lock is not None
        relay = self._relay
        if message["type"] != "http.response.body":
            # Trailers were excluded at the start; anything else goes on in order.
            async with self._lock:
                if not self._body_closed:
                    await self._server_send(message)
            return
        body = message.get("body", b"")
        if body.__class__ is not bytes:
            body = bytes(body)  # Starlette passes an app's memoryview chunks on as they are
        more: bool = message.get("more_body", False)
        try:
            async with self._lock:
                now = self._loop.time()
                if self._body_closed:
                    # The stream already ended (error event, client gone): what the
                    # app still sends is metered (zombie tokens), never written.
                    if body:
                        relay.feed(body, now)
                    self._app_closed = not more
                    self._unyielded += len(body)
                    if self._unyielded < _ZOMBIE_BURST:
                        return
                    self._unyielded = 0
                    zombie_burst = True
                else:
                    zombie_burst = False
                    out = relay.feed(body, now) if body else b""
                    if not more:
                        self._app_closed = True
                        out += relay.upstream_eof(now)
                    if relay.done:
                        await self._write(out, last=True, bounded=False)
                    elif out:
                        await self._write(out, last=False, bounded=False)
        except asyncio.CancelledError:
            if self._body_closed and self._take_back_stop():
                return
            raise
        if zombie_burst:
            # Outside the try: a pending stop lands here in an app that awaits
            # nothing but send().
            await asyncio.sleep(0)
            return
        if relay.done and more:
            # A limit ended the stream mid-body: stop the app like a gone client's.
            self._stop_app()

    def _take_back_stop(self) -> bool:
        """Our stop reached the app in send() after its stream ended: make it land elsewhere.

        Cancelled in send(), a framework that iterates the app's generator
        (Starlette's ``StreamingResponse``) leaves the generator suspended at
        its ``yield``, its ``finally`` (where the app closes its provider
        stream) not run until the garbage collector finds it. That is where a
        client too slow to read always leaves the app. So send() returns
        instead (the body is closed, nothing is written), and the stop lands
        where the app next waits: in its generator. True if it was taken back.
        """
        task = asyncio.current_task()
        if not self._cancel_requested or task is None:
            return False
        if task is not self._task:
            # A framework's child task (Starlette's task group), cancelled because
            # we cancelled the request's task: it is cancelled again where it next waits.
            return True
        self._cancel_requested = False
        if task.uncancel() > self._base_cancelling:
            return False  # someone else's cancellation as well: it goes on
        self._stop_app()
        return True

    async def _write(self, out: bytes, *, last: bool, bounded: bool) -> bool:
        """Send relay output, under the lock. False if the client is gone or too slow.

        The app's own writes are not bounded here (a timeout per event would
        tax every event); the timer watches them. The timer's and the final
        writes are bounded by ``client_write_timeout``.
        """
        if last:
            self._body_closed = True
        message = {"type": "http.response.body", "body": out, "more_body": not last}
        try:
            if bounded:
                assert self._route is not None
                async with asyncio.timeout(self._route.client_write_timeout or None):
                    await self._server_send(message)
            else:
                await self._server_send(message)
        except TimeoutError:
            self._too_slow()
            return False
        except OSError:
            # ASGI 2.4 servers raise on a closed connection instead of (or
            # before) reporting http.disconnect.
            self._client_left()
            if not bounded:
                raise  # the app's own send: it hears what the server said
            self._stop_app()
            return False
        return True

    # -- timers --------------------------------------------------------------

    async def _keep_time(self) -> None:
        """Call ``relay.poll`` at ``relay.deadline``; write what it returns."""
        relay, lock, route = self._relay, self._lock, self._route
        assert relay is not None and lock is not None and route is not None
        loop = self._loop
        while not self._body_closed:
            deadline = relay.deadline
            if deadline is None:
                return
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                # The lock is only held long by a write the client is not taking.
                async with asyncio.timeout(route.client_write_timeout or None):
                    await lock.acquire()
            except TimeoutError:
                self._too_slow()
                return
            try:
                if self._body_closed:
                    return
                out = relay.poll(loop.time())
                if relay.done:
                    await self._write(out, last=True, bounded=True)
                elif out and not await self._write(out, last=False, bounded=True):
                    return
            finally:
                lock.release()
            if relay.done:
                self._stop_app()
                return

    # -- the client going away -----------------------------------------------

    def _client_disconnected(self) -> None:
        """The inbox saw ``http.disconnect``."""
        if self._body_closed:
            # The response had ended: servers report a disconnect once it is
            # complete (uvicorn does at once). Nothing to cancel.
            return
        self._client_left()
        self._stop_app()

    def _client_left(self) -> None:
        if self._client_gone:
            return
        now = self._loop.time()
        self._client_gone = True
        self._body_closed = True
        self._gone_at = now
        if self._relay is not None:
            self._relay.client_gone(now)

    def _too_slow(self) -> None:
        if self._client_gone:
            return
        now = self._loop.time()
        self._client_gone = True
        self._body_closed = True
        assert self._relay is not None
        self._relay.client_too_slow(now)
        self._stop_app()

    def _stop_app(self) -> None:
        """Cancel the app's task (where its generator waits on its provider)."""
        if not self._app_running or self._cancel_requested or self._task is None:
            return
        if asyncio.current_task() is self._task:
            # Never cancel the running task itself: the cancellation could
            # outlive the app and land in the server. Do it once it waits.
            self._loop.call_soon(self._cancel_app)
        else:
            self._cancel_app()

    def _cancel_app(self) -> None:
        if self._app_running and not self._cancel_requested and self._task is not None:
            self._cancel_requested = True
            self._task.cancel()

    # -- the end -------------------------------------------------------------

    async def _end(self, error: BaseException | None, cancelled_from_outside: bool) -> bool:
        """Finish the stream after the app returned or raised; True to re-raise ``error``."""
        relay = self._relay
        assert relay is not None
        now = self._loop.time()
        if self._gone_at is not None and self._cancel_requested:
            # Client gone noticed to the app's task unwound (its finally ran).
            relay.meter.cancel_propagation = now - self._gone_at
        reraise = False
        try:
            out = b""
            if cancelled_from_outside:
                # The server is stopping the request: say so if the client can hear it.
                out = relay.shutdown(now)
                reraise = True
            elif not relay.done:
                if error is None:
                    out = relay.upstream_eof(now)
                else:
                    out = relay.upstream_failed(now)
                    log.error(
                        "the app raised after its stream had started; the stream ended with %s",
                        relay.meter.error_code or relay.end_state,
                        exc_info=error,
                    )
            elif error is not None and self._app_closed and not self._cancel_requested:
                # The app finished its response and raised afterwards (a
                # background task, say): not the stream's business.
                reraise = True
            elif error is not None and not isinstance(error, asyncio.CancelledError):
                log.debug("the app raised after its stream had ended", exc_info=error)
            await self._finish_body(out)
        finally:
            await self._stop_helpers()
            self._publish()
        return reraise

    async def _finish_body(self, out: bytes) -> None:
        assert self._lock is not None
        if self._body_closed:
            return
        async with self._lock:
            if not self._body_closed:
                await self._write(out, last=True, bounded=True)

    async def _stop_helpers(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None and not timer.done():
            timer.cancel()
            await asyncio.wait((timer,))
        await self._inbox.stop()

    def _publish(self) -> None:
        relay, route = self._relay, self._route
        assert relay is not None and route is not None
        if not relay.done:  # an unexpected path in this face: never publish an open stream
            relay.client_gone(self._loop.time())
        scope = self._scope
        self._context.streams.close(
            StreamRecord(
                self._stream_id,
                route.route,
                str(scope.get("method", "")),
                str(scope.get("path", "")),
                self._status,
                relay.dialect,
                relay.meter,
            )
        )


def _decode(message: Message) -> list[tuple[str, str]]:
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in message.get("headers") or ()
    ]


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    # ASGI header names are lower-case byte strings.
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
