"""One request through the middleware: the ASGI twin of the sidecar's relay loop.

A :class:`StreamResponder` runs the app for one HTTP request with its own
``send`` (and the :class:`~streamwarden.middleware.inbox.Inbox` as its
``receive``). It decides at ``http.response.start`` whether the response
is a stream, by the same rule as the sidecar
(:func:`~streamwarden.dialects.stream_framing`); every other response is
handed to the server message by message, untouched. Its two helpers have
a job each: :class:`~streamwarden.middleware.admission.Admission` says
whether the request asks for a stream and holds its
``max_concurrent_streams`` slot, and
:class:`~streamwarden.middleware.app_task.AppTask` stops the app when the
stream's upstream has to be closed.

For a stream it moves bytes and time through a core
:class:`~streamwarden.relay.Relay`, like the sidecar does:

- the app's body chunks are fed to the relay and only what it returns is
  sent, so a partial event is held back until its last byte arrives;
- a timer task calls ``relay.poll`` at ``relay.deadline`` (keep-alives,
  ``upstream_idle_timeout``, ``max_stream_duration``);
- every write to the server (app body, keep-alive, error event, end of
  body) happens under one lock, so two sends never overlap and the bytes
  leave in the order the relay produced them;
- the inbox watches for ``http.disconnect``; the app's "upstream" is the
  app itself, so closing it means stopping the app.

Before the response. An app usually awaits its provider's response headers
(the whole prefill, seconds for a long prompt) before it starts its own
stream. A request that asks for a stream is watched from the moment the
app has read its whole body, or from the start if it has none; a client
that leaves before the response starts gets the app stopped, so the app's
provider request is closed at once, as the sidecar closes its upstream
request. Such a request ends without a stream record, as in the sidecar.
Other requests are never watched before their response: stopping them
could cut an app's work short, and watching would cost each of them a
task.

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
from streamwarden.headers import drop_hop_by_hop, stream_response_headers
from streamwarden.inflate import InflateError, Inflater
from streamwarden.middleware._asgi import ASGIApp, Message, Receive, Scope, Send
from streamwarden.middleware.admission import Admission
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.inbox import Inbox
from streamwarden.middleware.resume import scope_headers
from streamwarden.middleware.streams import FaceContext
from streamwarden.pipeline import PipelineStream, StreamStart, request_headers
from streamwarden.plan import StreamPlan, plan_response
from streamwarden.relay import Relay

__all__ = ["StreamResponder"]

log = logging.getLogger("streamwarden.middleware")

# Most inflated bytes handed to the relay (and written) per step.
_INFLATE_STEP = 64 * 1024
# Bytes an app may send after its stream ended without waiting once: beyond
# them its send() yields, so that a pending stop can land in an app that
# awaits nothing else.
_ZOMBIE_BURST = 1 << 20


class _Phase(enum.Enum):
    WAITING = "waiting"  # no http.response.start yet
    PASSING = "passing"  # not a stream: messages go to the server untouched
    STREAMING = "streaming"  # a stream, relayed


class StreamResponder:
    """One HTTP request through the middleware; a fresh one per request."""

    __slots__ = (
        "_admission",
        "_app_closed",
        "_app_task",
        "_body_closed",
        "_client_gone",
        "_context",
        "_flow",
        "_gone_at",
        "_inbox",
        "_inflater",
        "_lock",
        "_loop",
        "_phase",
        "_relay",
        "_route",
        "_scope",
        "_server_send",
        "_started_at",
        "_status",
        "_timer",
        "_trace",
        "_unyielded",
        "_watching_early",
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
        self._admission = Admission(context.streams, scope, inbox)
        self._app_task = AppTask(self._loop)
        # Stream state, set when a stream starts.
        self._relay: Relay | None = None
        self._inflater: Inflater | None = None
        self._route: ResolvedRoute | None = None
        self._status = 200
        #: The stream through the pipeline: its relay, its stages, its end.
        self._flow: PipelineStream | None = None
        self._lock: asyncio.Lock | None = None
        self._timer: asyncio.Task[None] | None = None
        #: No more writes to the client: the body ended, or the client is gone.
        self._body_closed = False
        #: The app sent its last body message (``more_body`` false).
        self._app_closed = False
        self._client_gone = False
        #: When the client's leaving stopped the app (cancel), for its cancel propagation.
        self._gone_at: float | None = None
        #: Bytes the app sent after the stream ended since its send() last yielded.
        self._unyielded = 0
        #: Watching for a disconnect before the response (see the module docstring).
        self._watching_early = False
        #: The request's OpenTelemetry spans, when telemetry is on.
        self._trace: Any = None

    # -- the request ---------------------------------------------------------

    async def run(self, app: ASGIApp) -> None:
        """Run the app for this request; return or raise as the app would have."""
        admission = self._admission
        admission.look_at_request(on_stream_asked=self._watch_early)
        if not await admission.admit(
            self._context.settings.max_concurrent_streams, self._server_send
        ):
            return
        telemetry = self._context.telemetry
        token = None
        if telemetry is not None:
            path: str = self._scope.get("path") or "/"
            route = self._context.settings.for_path(path).route
            headers = {name.lower(): value for name, value in scope_headers(self._scope)}
            self._trace = telemetry.request(str(self._scope.get("method", "GET")), route, headers)
            token = self._trace.activate()
        try:
            await self._run(app)
        except asyncio.CancelledError:
            self._status = 499 if self._phase is not _Phase.STREAMING else self._status
            raise
        except BaseException:
            if self._phase is not _Phase.STREAMING:
                self._status = 500
            raise
        finally:
            admission.release()
            if self._trace is not None:
                self._trace.deactivate(token)
                if self._phase is not _Phase.STREAMING:
                    self._trace.end(self._status)

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
            await self._send_streamed(message)
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

    async def _start_stream(
        self, message: Message, headers: Mapping[str, str], plan: StreamPlan
    ) -> None:
        context = self._context
        scope = self._scope
        path: str = scope.get("path") or "/"
        route = context.settings.for_path(path)
        loop = self._loop
        if route.resumable and context.resume is not None:
            await context.resume.ensure_started()  # the store's connection: I/O, ours
        self._status = int(message.get("status", 200))
        self._flow = flow = context.pipeline.open(
            StreamStart(
                "middleware",
                route,
                plan,
                str(scope.get("method", "")),
                path,
                self._status,
                request_headers(scope_headers(scope)),
                headers,
                self._started_at,
                loop.time(),
                trace=self._trace,
            )
        )
        flow.on_stop = self._stop_by_owner
        relay = flow.relay
        # Compressed streams are inflated and relayed, as in the sidecar
        # (plan.py says why), a bounded step at a time.
        self._inflater = Inflater(plan.encoding) if plan.decoded else None
        self._phase = _Phase.STREAMING
        self._admission.stop_looking()
        self._relay = relay
        self._route = route
        self._lock = asyncio.Lock()
        context.streams.open(self)
        start = dict(message)
        headers_out = stream_response_headers(
            drop_hop_by_hop(_decode(message)), drop_encoding=plan.decoded
        )
        headers_out.extend(flow.headers)
        start["headers"] = _encode(headers_out)
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
                    # app still sends is metered (zombie tokens), never written. A
                    # compressed one is inflated only where the relay reads on (drain
                    # meters it, detach journals it for a resume), not just to count.
                    if body and self._inflater is None:
                        relay.feed(body, now)
                    elif body and relay.draining:
                        await self._feed_inflated(body, now)  # the gone client gets nothing
                    self._app_closed = not more
                    self._unyielded += len(body)
                    if self._unyielded < _ZOMBIE_BURST:
                        return
                    self._unyielded = 0
                    zombie_burst = True
                else:
                    zombie_burst = False
                    if self._inflater is not None:
                        out = await self._feed_inflated(body, now)
                    else:
                        out = relay.feed(body, now) if body else b""
                    if not more and not relay.done:
                        self._app_closed = True
                        out += relay.upstream_eof(self._loop.time())
                    elif not more:
                        self._app_closed = True
                    if relay.done:
                        await self._write(out, last=True, bounded=False)
                    elif out:
                        await self._write(out, last=False, bounded=False)
        except asyncio.CancelledError:
            if self._body_closed and self._app_task.take_back_in_send():
                return
            raise
        if zombie_burst:
            # Outside the try: a pending stop lands here in an app that awaits
            # nothing but send().
            await asyncio.sleep(0)
            return
        if relay.done and more:
            # A limit ended the stream mid-body: stop the app like a gone client's.
            self._app_task.stop()

    async def _feed_inflated(self, body: bytes, now: float) -> bytes:
        """Inflate the app's compressed chunk a step at a time; the last step's output.

        Each full step is written before the next is inflated (under the
        lock, awaiting the server), so a bomb costs one step of memory and
        waits for a slow client like any stream.
        """
        inflater = self._inflater
        relay = self._relay
        assert inflater is not None and relay is not None
        inflater.feed(body)
        out = b""
        while inflater.pending and not relay.done:
            if out:
                await self._write(out, last=False, bounded=False)
            try:
                piece = inflater.take(_INFLATE_STEP)
            except InflateError:
                return relay.upstream_failed(self._loop.time())
            out = relay.feed(piece, self._loop.time()) if piece else b""
        return out

    async def _write(self, out: bytes, *, last: bool, bounded: bool) -> bool:
        """Send relay output, under the lock. False if the client is gone or too slow.

        The app's own writes are not bounded here (a timeout per event would
        tax every event); the timer watches them. The timer's and the final
        writes are bounded by ``client_write_timeout``.
        """
        if last:
            self._close_body()
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
            assert self._relay is not None
            if self._relay.draining:
                return False  # drain or detach: the app runs on, its send does not fail
            if not bounded:
                raise  # the app's own send: it hears what the server said
            self._app_task.stop()
            return False
        return True

    def _close_body(self) -> None:
        """No more writes to the client: its stream is over, and so is its slot.

        The slot goes back before the last bytes are handed to the server:
        a client may ask again the moment it has them (an agent loop does),
        long before the app and the middleware's helpers have unwound.
        """
        self._body_closed = True
        self._admission.release()

    # -- timers --------------------------------------------------------------

    async def _keep_time(self) -> None:
        """Call ``relay.poll`` at ``relay.deadline``; write what it returns."""
        relay, lock, route = self._relay, self._lock, self._route
        assert relay is not None and lock is not None and route is not None
        loop = self._loop
        while not self._body_closed or relay.draining:
            deadline = relay.deadline
            if deadline is None:
                return
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._body_closed:
                # Drain or detach, the client gone: only the clock runs on.
                await self._run_detached_clock()
                if relay.done:
                    self._app_task.stop()
                    return
                continue
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
                self._app_task.stop()
                return

    async def _run_detached_clock(self) -> None:
        """A timer of a stream whose client left: a resume's hold, then the relay's limits."""
        relay, flow = self._relay, self._flow
        assert relay is not None and flow is not None
        loop = self._loop
        if flow.holds is not None and relay.detach_due(loop.time()):
            left = await flow.holds()
            if left is not None:
                relay.keep_detached(loop.time() + left)
                relay.resumed()
        relay.poll(loop.time())  # writes nothing: there is nobody to write to

    def _rearm_timer(self) -> None:
        """Make the timer look at the relay's deadline again (it may have moved sooner)."""
        timer = self._timer
        if timer is None or timer is asyncio.current_task():
            return  # none yet, or it is the caller: its loop reads the deadline next
        timer.cancel()
        self._timer = self._loop.create_task(self._keep_time())

    def _stop_by_owner(self) -> None:
        """An explicit stop (``DELETE``) of this resumable stream by its owner."""
        if self._relay is not None and not self._relay.done:
            self._relay.stop(self._loop.time())
            self._app_task.stop()

    # -- the client going away -----------------------------------------------

    def _client_disconnected(self) -> None:
        """The inbox saw ``http.disconnect``."""
        if self._body_closed:
            # The response had ended: servers report a disconnect once it is
            # complete (uvicorn does at once). Nothing to cancel.
            return
        self._client_left()
        if self._relay is None or not self._relay.draining:
            self._app_task.stop()

    def _client_left(self) -> None:
        if self._client_gone:
            return
        now = self._loop.time()
        self._client_gone = True
        self._close_body()
        relay, route = self._relay, self._route
        if relay is not None and route is not None:
            # on_client_gone: the app runs on for a resume (detach) or to its
            # end (drain), or is stopped (cancel, the caller's).
            detach = relay.journal is not None
            relay.client_gone(
                now,
                drain=route.on_client_gone == "drain",
                detach_until=now + route.resume_window if detach else None,
            )
            if relay.draining:
                self._inbox.hides_disconnect = True  # the app runs on, unaware
                self._rearm_timer()  # a detached stream's deadline came sooner
            assert self._flow is not None
            self._flow.counted_detached = self._context.pipeline.end.count_detached(relay)
        elif relay is not None:
            relay.client_gone(now)
        if relay is None or not relay.draining:
            # The app is stopped because its client left: its unwinding is the
            # cancel propagation. An app that runs on (drain, detach) and is
            # stopped later, by a window or a limit, has none, as in the sidecar.
            self._gone_at = now

    def _too_slow(self) -> None:
        if self._client_gone:
            return
        now = self._loop.time()
        self._client_gone = True
        self._close_body()
        assert self._relay is not None
        self._relay.client_too_slow(now)
        self._app_task.stop()

    # -- the end -------------------------------------------------------------

    async def _end(self, error: BaseException | None, cancelled_from_outside: bool) -> bool:
        """Finish the stream after the app returned or raised; True to re-raise ``error``."""
        relay = self._relay
        assert relay is not None
        now = self._loop.time()
        if self._gone_at is not None and self._app_task.stop_requested:
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
            elif error is not None and self._app_closed and not self._app_task.stop_requested:
                # The app finished its response and raised afterwards (a
                # background task, say): not the stream's business.
                reraise = True
            elif error is not None and not isinstance(error, asyncio.CancelledError):
                log.debug("the app raised after its stream had ended", exc_info=error)
            await self._finish_body(out)
        finally:
            try:
                await self._stop_helpers()
            finally:
                # Published even if the server cancels us while the helpers
                # unwind: a stream left out of the register is never recorded.
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
        assert self._flow is not None
        self._context.pipeline.finish(self, self._flow, self._loop.time())


def _decode(message: Message) -> list[tuple[str, str]]:
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in message.get("headers") or ()
    ]


def _encode(headers: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    # ASGI header names are lower-case byte strings.
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers]
