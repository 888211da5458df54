"""One request through the middleware: the ASGI twin of the sidecar's relay loop.

A :class:`StreamResponder` runs the app for one HTTP request with its own
``send`` (and the :class:`~streamwarden.middleware.inbox.Inbox` as its
``receive``). It decides at ``http.response.start`` whether the response
is a stream, by the same rule as the sidecar
(:func:`~streamwarden.core.dialects.stream_framing`); every other response is
handed to the server message by message, untouched. Its two helpers have
a job each: :class:`~streamwarden.middleware.admission.Admission` says
whether the request asks for a stream and holds its
``max_concurrent_streams`` slot, and
:class:`~streamwarden.middleware.app_task.AppTask` stops the app when the
stream's upstream has to be closed.

For a stream it moves bytes and time through a core
:class:`~streamwarden.core.relay.Relay`, like the sidecar does, with a part
each:

- the app's body chunks are fed to the relay and only what it returns is
  sent, so a partial event is held back until its last byte arrives
  (:class:`~streamwarden.middleware.body.AppBody`);
- a timer task calls ``relay.poll`` at ``relay.deadline`` (keep-alives,
  ``upstream_idle_timeout``, ``max_stream_duration``:
  :class:`~streamwarden.middleware.clock.StreamClock`);
- every write to the server (app body, keep-alive, error event, end of
  body) goes through one writer, under one lock, so two sends never
  overlap and the bytes leave in the order the relay produced them; the
  writer also hears the client leave
  (:class:`~streamwarden.middleware.writer.ClientWriter`);
- the inbox watches for ``http.disconnect``; the app's "upstream" is the
  app itself, so closing it means stopping the app.

The end (:meth:`StreamResponder._end`, below) is this module's: once the
app returned or raised, the relay gets the end that matches, the last
bytes go out, the helpers stop, and the stream is published.

Before the response. An app usually awaits its provider's response headers
(the whole prefill, seconds for a long prompt) before it starts its own
stream. A request that asks for a stream is watched from the moment the
app has read its whole body, or from the start if it has none; a client
that leaves before the response starts gets the app stopped, so the app's
provider request is closed at once, as the sidecar closes its upstream
request. Such a request ends without a stream record, as in the sidecar.
Other requests are never watched before their response: stopping them
could cut an app's work short, and watching would cost each of them a
task. On a route with ``early_headers_after``, a watched request whose app
has not started by then gets the stream opened and its head sent by the
middleware (:mod:`~streamwarden.middleware.early`); the app's own start
is then judged, not sent.

How a stream ends (one end state each, recorded by the relay):

- the app finishes its body: ``completed``, or ``stream_truncated`` with the
  dialect's error event if a known dialect's terminal event is missing;
- the app raises after the response started: ``upstream_error`` with the
  error event and a clean end of body; the exception is logged with its
  traceback and not re-raised (before the response started, exceptions
  propagate untouched);
- the client disconnects: ``client_cancelled``, the app is stopped
  (before the response started: no stream, the app is stopped, and the
  request ends quietly);
- a timer or limit fires: the error event, a clean end, the app stopped;
- the client stops reading for ``client_write_timeout``: ``client_too_slow``,
  the app is stopped and the response is left unfinished, so the server
  drops the connection;
- the server cancels the request (a shutdown): ``shutting_down``, then the
  cancellation goes on up.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from streamwarden.config import ResolvedRoute
from streamwarden.core.headers import drop_hop_by_hop, stream_response_headers
from streamwarden.core.inflate import Inflater
from streamwarden.core.lifecycle import Next
from streamwarden.core.plan import EARLY_PLAN, StreamPlan, plan_response
from streamwarden.middleware._asgi import ASGIApp, Message, Receive, Scope, Send
from streamwarden.middleware.admission import Admission
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.body import AppBody
from streamwarden.middleware.clock import StreamClock
from streamwarden.middleware.early import EARLY_HEADERS, EARLY_START, EarlyAnswer, EarlyHead
from streamwarden.middleware.inbox import Inbox
from streamwarden.middleware.resume import (
    FirstMessage,
    answer,
    describe,
    has_body,
    scope_headers,
)
from streamwarden.middleware.streams import FaceContext
from streamwarden.middleware.writer import ClientWriter
from streamwarden.pipeline import PipelineStream, StreamStart
from streamwarden.pipeline.request import Forward

__all__ = ["StreamResponder"]

log = logging.getLogger("streamwarden.middleware")


class _Phase(enum.Enum):
    WAITING = "waiting"  # no http.response.start yet
    PASSING = "passing"  # not a stream: messages go to the server untouched
    STREAMING = "streaming"  # a stream, relayed


class StreamResponder:
    """One HTTP request through the middleware; a fresh one per request."""

    __slots__ = (
        "_admission",
        "_app_task",
        "_body",
        "_clock",
        "_context",
        "_early",
        "_flow",
        "_inbox",
        "_loop",
        "_phase",
        "_scope",
        "_server_send",
        "_started_at",
        "_status",
        "_trace",
        "_watching_early",
        "_writer",
    )

    def __init__(self, context: FaceContext, scope: Scope, receive: Receive, send: Send) -> None:
        self._context = context
        self._scope = scope
        self._server_send = send
        self._inbox = inbox = Inbox(receive)
        self._loop = asyncio.get_running_loop()
        #: When the request arrived: the stream's TTFT and duration count from here.
        self._started_at = self._loop.time()
        self._phase = _Phase.WAITING
        self._admission = Admission(scope, inbox)
        self._app_task = AppTask(self._loop)
        self._status = 200
        # Stream state, set when a stream starts.
        #: The stream through the pipeline: its relay, its stages, its end.
        self._flow: PipelineStream | None = None
        #: Its writes and its client (see the module docstring), its app's body, its timer.
        self._writer: ClientWriter | None = None
        self._body: AppBody | EarlyAnswer | None = None
        self._clock: StreamClock | None = None
        #: Watching for a disconnect before the response (see the module docstring).
        self._watching_early = False
        #: With ``early_headers_after``: when our own head is due (middleware/early.py).
        self._early: EarlyHead | None = None
        #: The request's OpenTelemetry spans, when telemetry is on.
        self._trace: Any = None

    # -- the request ---------------------------------------------------------

    async def run(self, app: ASGIApp) -> None:
        """Run the app for this request; return or raise as the app would have."""
        step, scope = self._context.pipeline.step, self._scope
        body = FirstMessage(self._inbox) if has_body(scope) else None
        incoming = describe(scope, step.route(scope.get("path") or "/"), body)
        self._trace = trace = step.traced(incoming)
        token = None if trace is None else trace.activate()
        try:
            decided = await step.decide(incoming)
            if not isinstance(decided, Forward):  # a resume, a stop, a refusal: never the app
                self._status = await answer(decided, self._inbox.receive, self._server_send)
                return
            first = None if body is None else body.first
            self._admission.look_at_request(self._watch_early, decided, first)
            await self._run(app)
        except asyncio.CancelledError:
            self._status = 499 if self._phase is not _Phase.STREAMING else self._status
            raise
        except BaseException:
            if self._phase is not _Phase.STREAMING:
                self._status = 500
            raise
        finally:
            self._admission.release()
            if self._early is not None:
                self._early.cancel()
            if trace is not None:
                trace.deactivate(token)
                if self._phase is not _Phase.STREAMING:
                    trace.end(self._status)

    async def _run(self, app: ASGIApp) -> None:
        self._app_task.started()
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
            self._app_task.finished()
        if self._phase is not _Phase.STREAMING:
            if self._watching_early:
                await self._end_unstreamed(None)
            return
        # Take back our own stop; a cancellation left is someone else's.
        outside = self._app_task.take_back()
        cancelled_from_outside = (
            isinstance(error, asyncio.CancelledError) if outside is None else outside
        )
        if await self._end(error, cancelled_from_outside) and error is not None:
            raise error

    async def _send(self, message: Message) -> None:
        """The ``send()`` handed to the app."""
        phase = self._phase
        if phase is _Phase.PASSING:
            await self._server_send(message)
        elif phase is _Phase.STREAMING:
            assert self._body is not None
            await self._body.send(message)
        elif message["type"] == "http.response.start":
            planned = self._stream_headers(message)
            if planned is None:
                self._phase = _Phase.PASSING
                self._status = int(message.get("status", 200))
                # Not a stream: it holds no stream slot, even if it asked for one.
                self._admission.release()
                await self._server_send(message)
            else:
                await self._start_stream(message, *planned)
        else:
            await self._server_send(message)

    # -- before the response -------------------------------------------------

    def _watch_early(self) -> None:
        """The request asks for a stream and its body is read: watch for its client leaving."""
        if self._phase is not _Phase.WAITING:
            return
        self._watching_early = True
        self._inbox.watch(self._client_left_before_start)
        after = self._context.settings.for_path(self._scope.get("path") or "/").early_headers_after
        if after > 0:
            self._early = EarlyHead(after, self._start_early)

    def _client_left_before_start(self) -> None:
        """The client left while the app was still preparing its response."""
        if self._phase is _Phase.WAITING:
            self._app_task.stop()

    async def _end_unstreamed(self, error: BaseException | None) -> bool:
        """Clean up after a request that never streamed; True if ``error`` was our own stop."""
        if not self._watching_early:
            return False
        await self._inbox.stop()
        outside = self._app_task.take_back()
        if outside is None:
            return False
        return not outside and isinstance(error, asyncio.CancelledError)

    # -- the start -----------------------------------------------------------

    def _stream_headers(self, message: Message) -> tuple[dict[str, str], StreamPlan] | None:
        """The response's headers (lower-case names) and plan if it is a stream, else None."""
        if message.get("trailers"):
            return None
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in message.get("headers") or ()
        }
        plan = plan_response(
            self._scope.get("method", "GET"),
            int(message.get("status", 200)),
            headers,
            self._context.extra_media_types,
        )
        return None if plan is None else (headers, plan)

    async def _start_early(self) -> None:
        """No ``http.response.start`` within ``early_headers_after``: ours goes first."""
        await self._start_stream(EARLY_START, EARLY_HEADERS, EARLY_PLAN, early=True)

    async def _may_start(self, message: Message, route: ResolvedRoute, early: bool) -> bool:
        """Whether this start still opens the stream: an await lets the other start go first."""
        if self._phase is not _Phase.WAITING:  # the early head, or the app, went first
            if not early:
                await self._send(message)  # the app's start, judged after our early head
            return False
        return not early or self._app_task.thinking  # not started, returned or stopped

    async def _start_stream(
        self, message: Message, headers: Mapping[str, str], plan: StreamPlan, early: bool = False
    ) -> None:
        context = self._context
        scope = self._scope
        path: str = scope.get("path") or "/"
        route = context.settings.for_path(path)
        if not await self._may_start(message, route, early):
            return
        self._status = int(message.get("status", 200))
        self._flow = flow = context.pipeline.open(
            StreamStart(
                "middleware",
                route,
                plan,
                str(scope.get("method", "")),
                path,
                self._status,
                tuple(scope_headers(scope)),
                headers,
                self._started_at,
                self._loop.time(),
                trace=self._trace,
                query_string=scope.get("query_string", b"").decode("latin-1"),
            )
        )
        flow.stop_by(self._stop_by_owner)
        self._phase = _Phase.STREAMING
        self._admission.stop_looking()
        writer = ClientWriter(
            self._server_send,
            flow,
            context.pipeline.end,
            self._admission,
            self._inbox,
            self._app_task,
        )
        # Compressed streams are inflated and relayed, as in the sidecar
        # (plan.py says why), a bounded step at a time.
        inflater = Inflater(plan.encoding) if plan.decoded else None
        self._writer, self._body = writer, AppBody(flow.relay, writer, self._app_task, inflater)
        if early:  # the app's own start is still to come, and to be judged
            extra = context.extra_media_types
            self._body = EarlyAnswer(self._body, flow.relay, writer, self._app_task, scope, extra)
        self._clock = clock = StreamClock(flow, writer, self._app_task)
        writer.rearm_clock = clock.rearm
        context.streams.open(self)
        start = dict(message)
        headers_out = stream_response_headers(
            drop_hop_by_hop(_decode(message)), drop_encoding=plan.decoded
        )
        start["headers"] = _encode(flow.head(headers_out))
        send_head = self._body.commit if isinstance(self._body, EarlyAnswer) else writer.send_head
        await send_head(start)
        self._inbox.watch(writer.client_disconnected)
        clock.start()

    # -- the end -------------------------------------------------------------

    def _stop_by_owner(self) -> None:
        """An explicit stop (``DELETE``) of this resumable stream by its owner."""
        if self._flow is not None and self._flow.relay.stop(self._loop.time()) is Next.CLOSE:
            self._app_task.stop()

    async def _end(self, error: BaseException | None, cancelled_from_outside: bool) -> bool:
        """Finish the stream after the app returned or raised; True to re-raise ``error``."""
        flow, writer, body, clock = self._flow, self._writer, self._body, self._clock
        assert flow is not None and writer is not None and body is not None and clock is not None
        relay = flow.relay
        now = self._loop.time()
        if writer.gone_at is not None and self._app_task.stop_requested:
            # Client gone noticed to the app's task unwound (its finally ran).
            relay.meter.cancel_propagation = now - writer.gone_at
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
            elif error is not None and body.app_closed and not self._app_task.stop_requested:
                # The app finished its response and raised afterwards (a
                # background task, say): not the stream's business.
                reraise = True
            elif error is not None and not isinstance(error, asyncio.CancelledError):
                log.debug("the app raised after its stream had ended", exc_info=error)
            await writer.finish(out)
        finally:
            try:
                await clock.stop()
                await self._inbox.stop()
            finally:
                # Published even if the server cancels us while the helpers
                # unwind: a stream left out of the register is never recorded.
                self._context.pipeline.finish(self, flow, self._loop.time())
        return reraise


def _decode(message: Message) -> list[tuple[str, str]]:
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in message.get("headers") or ()
    ]


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    # ASGI header names are lower-case byte strings.
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
