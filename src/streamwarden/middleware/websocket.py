"""A WebSocket session that carries streams (the Responses API's), between the server and the app.

For a ``websocket`` scope on a path whose dialect carries streams
(:func:`~streamwarden.core.messages.carries_streams`: the sidecar's rule),
the app's ``receive`` and ``send`` are wrapped so that the client's text
messages (the app's input) and the app's own (its "upstream" side) go
through one :class:`~streamwarden.core.messages.MessageSession`, the
sidecar's: each ``response.create`` is a stream through the pipeline,
metered, limited, filtered, traced and recorded as the sidecar's are, and
holds one of ``max_concurrent_streams`` (:class:`~streamwarden.pipeline.step.SessionSlots`).
What each message means is the session's to say; this module only moves
ASGI messages and time:

- the client's messages reach the app as they came, but a
  ``response.create`` past ``max_concurrent_streams``: the app never sees
  it, the client gets the ``error`` message refusing it;
- the app's reach the client as they came (or as the output filters let
  them out), unless the session cuts a stream on one;
- a cut (the relay ends a stream on a message: an event over
  ``max_event_bytes``, a broken tool call; a timer: silence past
  ``upstream_idle_timeout``, ``max_stream_duration``; the app closing, with
  any code, or returning or raising while a response is open) reaches the
  client as the ``error`` message and a 1011 close, never as a normal end,
  and the app is stopped; what it sends after goes nowhere;
- the client leaving (``websocket.disconnect``, or a send the server
  refuses) ends the open streams ``client_cancelled`` and stops the app at
  once (:class:`~streamwarden.middleware.app_task.AppTask`); its unwinding
  is the streams' cancel propagation. While it answers, an app seldom calls
  ``receive()``: the :class:`~streamwarden.middleware.inbox.Inbox` watches
  for the disconnect meanwhile, from the first stream on.

Binary messages and everything else pass untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from streamwarden.config import ResolvedRoute
from streamwarden.core.messages import CUT_CLOSE_CODE, MessageSession
from streamwarden.core.relay import Relay
from streamwarden.middleware._asgi import ASGIApp, Message, Receive, Scope, Send
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.inbox import Inbox
from streamwarden.middleware.resume import describe
from streamwarden.middleware.streams import FaceContext
from streamwarden.pipeline import PipelineStream, StreamStart
from streamwarden.pipeline.step import SessionSlots

__all__ = ["MessageStreams"]

log = logging.getLogger("streamwarden.middleware")

_DISCONNECT = "websocket.disconnect"
#: An app that returns with a response open ended its "upstream" as a close
#: does (``websocket.close``'s default code): the response is truncated.
_RETURNED = 1000
# What a send to a session the server has closed raises (uvicorn:
# ClientDisconnected, an OSError, or a RuntimeError once it saw the close).
_GONE = (OSError, RuntimeError)


class MessageStreams:
    """One WebSocket session through the middleware; a fresh one per session."""

    __slots__ = (
        "_app_task",
        "_clock",
        "_context",
        "_flows",
        "_gone",
        "_gone_at",
        "_inbox",
        "_lock",
        "_loop",
        "_over",
        "_path",
        "_receive",
        "_route",
        "_scope",
        "_server_send",
        "_slots",
        "_wake",
        "session",
    )

    def __init__(
        self,
        context: FaceContext,
        route: ResolvedRoute,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        self._context = context
        self._route = route
        self._scope = scope
        self._path: str = scope.get("path") or "/"
        self._receive = receive
        self._server_send = send
        self._loop = asyncio.get_running_loop()
        # The app keeps reading the client all session long: one message held
        # at most, the server's own queue holds the rest back as it does directly.
        self._inbox = Inbox(self._from_client, disconnect=_DISCONNECT, hold_at_most=1)
        self._app_task = AppTask(self._loop)
        self._flows: dict[Relay, PipelineStream] = {}
        #: The ``max_concurrent_streams`` places the session's responses hold.
        self._slots = SessionSlots(context.pipeline.step, route.dialect, self._path)
        self.session = MessageSession(self._open, self._finish, self._slots.admit)
        #: Held for every send to the client: a cut's error and close come after
        #: what went before them, and two sends never overlap.
        self._lock = asyncio.Lock()
        #: Nothing more reaches the client: a stream was cut, or the client left.
        self._over = False
        #: The streams the client's leaving ended, and when it left.
        self._gone: list[Relay] = []
        self._gone_at: float | None = None
        #: Runs the streams' timers, from the first stream on.
        self._clock: asyncio.Task[None] | None = None
        #: Set when the session's deadline may have moved sooner (a stream opened).
        self._wake = asyncio.Event()

    async def run(self, app: ASGIApp) -> None:
        """Run the app for this session; return or raise as it would have."""
        self._app_task.started()
        error: BaseException | None = None
        try:
            await app(self._scope, self._inbox.receive, self._send)
        except BaseException as exc:
            error = exc
        finally:
            self._app_task.finished()
        try:
            raise_on = await self._end(error)
        finally:
            try:
                await self._stop_helpers()
            finally:
                # Recorded even if the server cancels us meanwhile: a stream left
                # out of the register is never recorded.
                try:
                    self.session.end(self._loop.time())
                finally:
                    self._slots.release()
        if raise_on and error is not None:
            raise error

    # -- the client's side ---------------------------------------------------

    async def _from_client(self) -> Message:
        """The server's ``receive()``, read by the session first (a ``response.create``
        opens its stream before the app sees it: its clock starts now)."""
        while True:
            message = await self._receive()
            text = message.get("text")
            if message.get("type") != "websocket.receive" or not isinstance(text, str):
                return message
            reply = self.session.client_reply(text, self._loop.time())
            if reply.answer is None:
                return message
            # Refused (no stream place left): the app never sees it, the client is told.
            async with self._lock:
                if not self._over:
                    with contextlib.suppress(*_GONE):
                        await self._server_send({"type": "websocket.send", "text": reply.answer})

    def _client_left(self) -> None:
        """The client is gone: its open streams end with it, and the app is stopped."""
        streams = self.session.streams
        if self._over or not streams:
            return  # cut already, or nothing open: the app hears of it as it would directly
        self._over = True
        now = self._loop.time()
        self.session.client_closed(now)
        self._gone, self._gone_at = streams, now
        self._app_task.stop()

    # -- the app's side ------------------------------------------------------

    async def _send(self, message: Message) -> None:
        """The ``send()`` handed to the app: its messages are the session's upstream."""
        async with self._lock:
            if not self._over:
                await self._pass_on(message)
                return
        # The session is over for the client: this goes nowhere, and the app's
        # stop lands here if it has not yet.
        await asyncio.sleep(0)

    async def _pass_on(self, message: Message) -> None:
        """One message of the app's, as the session says (the caller holds the lock)."""
        kind = message.get("type")
        now = self._loop.time()
        if kind == "websocket.send" and isinstance(text := message.get("text"), str):
            reply = self.session.upstream_message(text, now)
            if reply.forward:
                await self._to_client(message)
            for out in reply.messages:  # what its output filters let out, in its place
                await self._to_client({"type": "websocket.send", "text": out})
            if reply.error is not None:
                await self._cut(reply.error)
        elif kind == "websocket.close":
            code = message.get("code", 1000)
            closing = self.session.upstream_closed(code if isinstance(code, int) else 1000, now)
            if closing.error is not None:  # a response was open: any close cuts it
                await self._cut(closing.error)
            else:
                await self._to_client(message)
        else:
            await self._to_client(message)

    async def _to_client(self, message: Message) -> None:
        try:
            await self._server_send(message)
        except OSError:
            # Servers raise on a closed session as well as (or before) telling receive().
            self._client_left()
            raise

    async def _cut(self, error: str) -> None:
        """A stream was cut: the ``error`` message, the error close, the app stopped.

        What the cut stream's output filters still held goes first. The
        caller holds the lock.
        """
        self._over = True
        with contextlib.suppress(*_GONE):
            for out in [*self.session.take_released(), error]:
                await self._server_send({"type": "websocket.send", "text": out})
            await self._server_send(
                {"type": "websocket.close", "code": CUT_CLOSE_CODE, "reason": "stream cut"}
            )
        self._app_task.stop()

    # -- the streams ---------------------------------------------------------

    def _open(self, started_at: float, now: float) -> Relay:
        pipeline = self._context.pipeline
        # Each response its own server span (telemetry on), as in the sidecar.
        trace = pipeline.step.traced(describe(self._scope, self._route, None))
        start = StreamStart.of_message(
            "middleware", self._route, self._path, started_at, now, trace
        )
        flow = pipeline.open(start)
        self._flows[flow.relay] = flow
        self._context.streams.open(flow.relay)
        self._wake.set()  # its timers run from now
        if self._clock is None:
            self._clock = self._loop.create_task(self._keep_time())
            self._inbox.watch(self._client_left)
        return flow.relay

    def _finish(self, relay: Relay, now: float) -> None:
        self._context.pipeline.finish(relay, self._flows.pop(relay), now)
        self._slots.stream_finished()

    async def _keep_time(self) -> None:
        """Run the streams' timers; on one that cuts its stream, cut the session."""
        session, loop, wake = self.session, self._loop, self._wake
        while not self._over:
            wake.clear()
            deadline = session.deadline
            if deadline is None:
                await wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                    await wake.wait()
            error = session.poll(loop.time())
            if error is not None:
                await self._cut_when_free(error)
                return

    async def _cut_when_free(self, error: str) -> None:
        """A timer's cut, once the app's send in flight is done (``client_write_timeout``)."""
        try:
            async with asyncio.timeout(self._route.client_write_timeout or None):
                await self._lock.acquire()
        except TimeoutError:
            # A send the client is not taking holds the lock: the app is
            # stopped, and the server drops the session when it returns.
            self._over = True
            self._app_task.stop()
            return
        try:
            if not self._over:
                await self._cut(error)
        finally:
            self._lock.release()

    # -- the end -------------------------------------------------------------

    async def _end(self, error: BaseException | None) -> bool:
        """The app returned or raised: end what is open; True to raise ``error`` on."""
        outside = self._app_task.take_back()  # None: never stopped; else someone else's left
        now = self._loop.time()
        if self._gone_at is not None:
            # Client gone noticed to the app unwound: its upstream closed.
            for relay in self._gone:
                relay.meter.cancel_propagation = now - self._gone_at
        if outside is False and isinstance(error, asyncio.CancelledError):
            return False  # our own stop, out of the app
        if outside or isinstance(error, asyncio.CancelledError):
            return True  # the server's cancellation goes on up; the streams end with the session
        if self._over or not self.session.streams:
            return True  # the app's return or raise is its own, as directly
        # The app ended with a response open: as an upstream that closed
        # (returned) or vanished (raised) mid-answer.
        closing = self.session.upstream_closed(None if error is not None else _RETURNED, now)
        if error is not None:
            log.error(
                "the app raised with a WebSocket response open; its stream was cut",
                exc_info=error,
            )
        async with self._lock:
            if closing.error is not None and not self._over:
                await self._cut(closing.error)
        return False

    async def _stop_helpers(self) -> None:
        clock, self._clock = self._clock, None
        if clock is not None and not clock.done():
            clock.cancel()
            await asyncio.wait((clock,))
        await self._inbox.stop()
