"""The proxy handler: forwards every request to the one upstream, relays streams.

Requests pass through unchanged (method, path, query, body streamed), minus
hop-by-hop headers and ``Expect`` (the sidecar answers ``100-continue``
itself), plus ``X-Forwarded-*``. The response's stream plan
(:mod:`streamwarden.plan`) decides: a stream goes through the one
:class:`~streamwarden.sidecar.driver.StreamDriver`; anything else is copied
byte for byte by :class:`~streamwarden.sidecar.driver.PassThrough`.

This module only wires things together: the upstream client is
:mod:`~streamwarden.sidecar.upstream`, every decision about a stream is the
relay's. The aiohttp server runs with ``handler_cancellation=True`` and the
driver hears of a client that leaves in the callback that read its FIN, so
the upstream connection is shut at once, even while the upstream is silent:
that is what makes an inference server stop generating.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.headers import drop_hop_by_hop, redact, redact_url, stream_response_headers
from streamwarden.meter import GapObserver
from streamwarden.metrics import StreamMetrics
from streamwarden.pipeline import (
    FaceServices,
    Pipeline,
    PipelineStream,
    StreamStart,
    request_headers,
)
from streamwarden.plan import StreamPlan, asks_for_stream, plan_response
from streamwarden.refusals import RefusalKind
from streamwarden.register import NO_SLOT, Slot
from streamwarden.resume import STREAM_ID_HEADER
from streamwarden.resume_service import ResumeService
from streamwarden.sidecar import resume as resuming
from streamwarden.sidecar.driver import PassThrough, StreamDriver
from streamwarden.sidecar.http import CLIENT_GONE, ClientChannel, refuse
from streamwarden.sidecar.injection import Buffered, Rewritten, UsageInjector, read_refusal
from streamwarden.sidecar.streams import ActiveStream, StreamTracker
from streamwarden.sidecar.upstream import (
    BodyTooLarge,
    ClientBodyBroken,
    Exchange,
    HeadTimeout,
    Origin,
    RequestBody,
    ResponseHead,
    UpstreamBroken,
    UpstreamError,
    UpstreamPool,
    open_exchange,
    request_head,
)
from streamwarden.sidecar.websocket import SessionListener, WebSocketRelay, is_websocket
from streamwarden.usage import UsageRole, refuses_stream_options

if TYPE_CHECKING:
    from streamwarden.telemetry import RequestTrace, Telemetry

__all__ = ["Proxy"]

log = logging.getLogger("streamwarden.proxy")

# Request headers that describe this hop's message framing or expectation,
# rebuilt (or answered) by the sidecar itself.
_REBUILT = frozenset({"host", "expect", "content-length", "transfer-encoding"})
# Methods whose requests may be sent twice (RFC 9110 section 9.2.2).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
#: Where a request keeps its OpenTelemetry spans (a typed key where aiohttp
#: has them, 3.13 and later).
_TRACE: Any = (
    web.RequestKey("streamwarden_trace", object)
    if hasattr(web, "RequestKey")
    else "streamwarden.trace"
)


class Proxy:
    """The reverse proxy; one per process, sharing one upstream connection pool."""

    def __init__(
        self,
        settings: Settings,
        tracker: StreamTracker,
        gap_observer: GapObserver | None = None,
        websocket_listener: SessionListener | None = None,
        metrics: StreamMetrics | None = None,
    ) -> None:
        if settings.upstream is None:
            raise ValueError("an upstream is required")
        self.settings = settings
        self.tracker = tracker
        self._gap_observer = gap_observer
        self._websocket_listener = websocket_listener
        self._extra_types = frozenset(t.lower() for t in settings.stream_media_types)
        upstream = settings.upstream
        self._authorization: str | None = None
        if upstream.startswith("unix:"):
            self.origin = Origin("http", "localhost", 80, upstream[len("unix:") :])
            self._prefix = ""
            self._ws_base = "http://localhost"
        else:
            url = URL(upstream)
            assert url.host is not None and url.port is not None
            self.origin = Origin(url.scheme, url.host, url.port)
            self._prefix = url.raw_path.rstrip("/")
            self._ws_base = str(url.with_user(None).with_password(None)).rstrip("/")
            if url.user is not None:
                # Credentials in the configured upstream URL are the
                # operator's: they are sent on every request, in place of
                # any Authorization the client sent (documented in README).
                token = f"{url.user}:{url.password or ''}".encode()
                self._authorization = "Basic " + base64.b64encode(token).decode()
        self.pool: UpstreamPool | None = None
        #: Streams read on after their client left (on_client_gone: drain).
        self._draining: set[asyncio.Future[None]] = set()
        self._websockets: WebSocketRelay | None = None
        self._trusted_networks = tuple(ipaddress.ip_network(n) for n in settings.trusted_proxies)
        self._injector = UsageInjector(settings.usage_injection_max_body_bytes)
        #: OpenTelemetry spans and GenAI metrics (otel_exporter), or None.
        self.telemetry: Telemetry | None = None
        if settings.otel_exporter != "none":
            from streamwarden.telemetry import Telemetry  # the otel extra, only when asked for

            on_error = metrics.otel_errors.inc if metrics is not None else None
            self.telemetry = Telemetry(settings, on_error, own_process=True)
        #: Resumes and stops, when some route keeps its streams for a resume.
        self.resume: ResumeService | None = None
        if ResumeService.wanted(settings):
            self.resume = ResumeService(settings, metrics)
        #: What runs on every stream, and where every stream ends.
        services = FaceServices("sidecar", settings, metrics, self.resume, gap_observer)
        self.pipeline: Pipeline[ActiveStream] = Pipeline(services, tracker)

    async def start(self) -> None:
        settings = self.settings
        context: ssl.SSLContext | None = None
        if self.origin.scheme == "https":
            context = ssl.create_default_context(cafile=settings.upstream_ca_bundle)
        self.pool = UpstreamPool(
            self.origin,
            connect_timeout=settings.upstream_connect_timeout,
            keepalive_timeout=settings.upstream_keepalive_timeout,
            max_idle=settings.upstream_pool_size,
            ssl_context=context,
        )
        if self.origin.unix_path is not None:
            connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
                path=self.origin.unix_path, limit=0
            )
        else:
            connector = aiohttp.TCPConnector(limit=0, ssl=context if context is not None else True)
        self._websockets = WebSocketRelay(
            connector, settings.keepalive_interval, self._websocket_listener
        )
        if self.resume is not None:
            await self.resume.start()

    async def close(self) -> None:
        for driving in list(self._draining):
            driving.cancel()
        if self._draining:
            await asyncio.wait(self._draining, timeout=1.0)
        if self._websockets is not None:
            await self._websockets.close()
            self._websockets = None
        if self.pool is not None:
            await self.pool.close()
            self.pool = None
        if self.resume is not None:
            await self.resume.close()
        if self.telemetry is not None:
            # Flushes what is queued, but a collector that is down must not
            # hold the exit past the drain: 2 s, then the thread is left.
            await self.telemetry.shutdown_within(2.0)

    # -- the handler -----------------------------------------------------------

    @property
    def handler(self) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        """The request handler: traced when telemetry is on, else without the wrapper
        (one coroutine less per request: its frame is part of every idle stream's memory)."""
        return self._handle if self.telemetry is None else self.handle

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The handler, with the request's OpenTelemetry spans around it."""
        assert self.telemetry is not None
        route = self.settings.for_path(request.path)
        trace = self.telemetry.request(request.method, route.route, request.headers)
        request[_TRACE] = trace
        try:
            response = await self._handle(request)
        except asyncio.CancelledError:
            if not trace.streaming:
                trace.end(499)  # the client left before its answer
            raise
        except BaseException:
            if not trace.streaming:
                trace.end(500)
            raise
        if not trace.streaming:
            trace.end(response.status)
        return response

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        # No open proxy: only origin-form targets reach the upstream, never
        # CONNECT (nor ``GET http://other/``).
        if request.method == "CONNECT":
            return refuse(RefusalKind.METHOD_NOT_ALLOWED)
        if not request.raw_path.startswith("/"):
            return refuse(RefusalKind.BAD_REQUEST_TARGET)
        settings = self.settings
        if log.isEnabledFor(logging.DEBUG):
            headers_seen = redact(request.headers.items(), settings.redact_headers)
            fields = {"method": request.method, "path": request.path, "headers": headers_seen}
            log.debug("request", extra={"fields": fields})
        limit = settings.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return refuse(RefusalKind.REQUEST_TOO_LARGE, limit=limit)
        if is_websocket(request):
            assert self._websockets is not None
            url = URL(self._ws_base + request.raw_path, encoded=True)
            return await self._websockets.relay(request, url, self._forwarded_headers(request))
        route = settings.for_path(request.path)
        stream_limit = settings.max_concurrent_streams
        if route.resumable and self.resume is not None:
            # A resume is served from the store and never reaches the
            # upstream: forwarding it would start a second generation.
            asked = resuming.position(request)
            if request.method == "DELETE" and (
                asked is not None or STREAM_ID_HEADER in request.headers
            ):
                return await resuming.stop_stream(self.resume, request, asked)
            if asked is not None:
                held = self.tracker.admit(stream_limit)
                if held is None:
                    return refuse(RefusalKind.TOO_MANY_STREAMS, limit=stream_limit)
                try:
                    return await resuming.serve_resume(self.resume, request, route, asked)
                finally:
                    held.release()
        body_start = b""
        if request.body_exists:
            if "Expect" in request.headers and not await _continue(request):
                return refuse(RefusalKind.EXPECTATION_FAILED)
            # Enough of the body to see '"stream": true'; it is sent on unchanged.
            body_start = await request.content.readany()
        wants_stream = asks_for_stream(
            request.headers.get("Accept"), request.query_string, body_start
        )
        trace: RequestTrace | None = request.get(_TRACE)
        if trace is not None:
            trace.named_model(body_start)
        rewritten: Rewritten | None = None
        usage: UsageRole = None
        early = wants_stream and route.early_headers_after > 0
        if (
            wants_stream
            and not early  # a refusal then is already an error event: nothing to retry
            and request.body_exists
            and self._injector.wanted(request, route)
        ):
            body_start, whole = await self._injector.read(request, body_start)
            if whole:
                rewritten, usage = self._injector.rewrite(request.path, body_start)
        body = self._request_body(request, body_start, rewritten)
        head = self._request_head(request, body, rewritten)
        slot = NO_SLOT
        if wants_stream:
            held = self.tracker.admit(stream_limit)
            if held is None:
                return refuse(RefusalKind.TOO_MANY_STREAMS, limit=stream_limit)
            slot = held
        try:
            return await self._forward(
                request,
                head,
                body,
                route,
                started,
                slot,
                early=early,
                rewritten=rewritten,
                usage=usage,
            )
        finally:
            slot.release()

    async def _forward(
        self,
        request: web.BaseRequest,
        head: bytes,
        body: RequestBody | None,
        route: ResolvedRoute,
        started: float,
        slot: Slot,
        *,
        early: bool,
        rewritten: Rewritten | None = None,
        usage: UsageRole = None,
    ) -> web.StreamResponse:
        """Send the request upstream and relay or copy back what it answers.

        With ``early`` (a request that asked for a stream, on a route with
        ``early_headers_after``), a slow upstream gets the client ``200
        text/event-stream`` and keep-alives while it thinks. With
        ``rewritten`` (usage injection), an upstream that refuses the
        option gets the client's own request once more; ``usage`` is the
        relay's part (take back what the option added, or watch a habit).
        """
        assert self.pool is not None
        opening: asyncio.Future[Exchange] | None = None
        try:
            if early:
                opening = asyncio.ensure_future(self._exchange(request, head, body))
                await asyncio.wait({opening}, timeout=route.early_headers_after)
                if not opening.done():
                    return await self._relay_early(request, opening, route, started, slot)
                exchange = opening.result()
            else:
                # Awaited in this task: a task of its own would stay referenced,
                # done, for the whole stream.
                exchange = await self._exchange(request, head, body)
            if rewritten is not None and exchange.head.status == 400:
                answered = await self._refused_injection(request, exchange, rewritten)
                if isinstance(answered, Buffered):
                    return _buffered_response(answered)
                exchange, usage = answered, None
        except asyncio.CancelledError:
            if opening is not None:
                opening.cancel()
            raise
        except UpstreamError as exc:
            return self._refusal_for(exc)
        plan = plan_response(
            request.method, exchange.head.status, exchange.head.headers, self._extra_types
        )
        if plan is None:
            slot.release()  # not a stream, whatever the request asked for
            return await self._pass_through(request, exchange, route)
        return await self._relay(request, exchange, plan, route, started, slot, usage=usage)

    def _exchange(
        self, request: web.BaseRequest, head: bytes, body: RequestBody | None
    ) -> Awaitable[Exchange]:
        assert self.pool is not None
        return open_exchange(
            self.pool,
            head,
            body,
            head_only=request.method == "HEAD",
            headers_timeout=self.settings.upstream_headers_timeout,
            idempotent=request.method in _IDEMPOTENT or "Idempotency-Key" in request.headers,
        )

    async def _refused_injection(
        self, request: web.BaseRequest, exchange: Exchange, rewritten: Rewritten
    ) -> Exchange | Buffered:
        """A 400 to a request the sidecar asked usage for: the option's fault, or the request's?

        If it names ``stream_options`` (old vLLM), the client's own request
        goes again, unchanged, and the upstream is left alone for a while;
        any other 400 is the client's, passed on as it came.
        """
        upstream = exchange.head
        text, whole = await read_refusal(exchange)
        if not refuses_stream_options(upstream.status, text):
            if not whole:
                raise UpstreamBroken("the upstream's 400 answer was cut or too long to relay")
            headers = [
                (n, v)
                for n, v in drop_hop_by_hop(upstream.headers.items())
                if n.lower() != "content-length"
            ]
            return Buffered(upstream.status, upstream.reason, headers, text)
        self._injector.refused()
        log.info("the upstream refused stream_options: requests go unchanged there for a while")
        original = RequestBody(
            start=rewritten.original,
            rest=None,
            chunked=False,
            limit=self.settings.max_request_body_bytes,
        )
        return await self._exchange(
            request, self._request_head(request, original, None, len(rewritten.original)), original
        )

    def _refusal_for(self, exc: UpstreamError) -> web.Response:
        """The error to answer before any response started: one map, for every failure."""
        if isinstance(exc, BodyTooLarge):
            return refuse(RefusalKind.REQUEST_TOO_LARGE, limit=self.settings.max_request_body_bytes)
        if isinstance(exc, ClientBodyBroken):
            return refuse(RefusalKind.REQUEST_BODY_INCOMPLETE)
        if isinstance(exc, HeadTimeout):
            return refuse(RefusalKind.UPSTREAM_TIMEOUT)
        # The error's own words name no header value and no URL query.
        log.warning(
            "upstream %s: %s: %s",
            redact_url(self.settings.upstream or ""),
            type(exc).__name__,
            exc,
        )
        # Refused, reset, or not HTTP: to the client, all of it is "unreachable".
        return refuse(RefusalKind.UPSTREAM_UNREACHABLE)

    def _new_stream(
        self,
        request: web.BaseRequest,
        route: ResolvedRoute,
        started: float,
        plan: StreamPlan,
        status: int,
        headers: Mapping[str, str],
        usage: UsageRole = None,
    ) -> tuple[ActiveStream, PipelineStream]:
        start = StreamStart(
            "sidecar",
            route,
            plan,
            request.method,
            request.path,
            status,
            request_headers(request.headers.items()),
            headers,
            started,
            asyncio.get_running_loop().time(),
            usage,
            request.get(_TRACE),
        )
        flow = self.pipeline.open(start)
        return ActiveStream(flow.stream_id, flow.relay, route.route), flow

    async def _relay(
        self,
        request: web.BaseRequest,
        exchange: Exchange,
        plan: StreamPlan,
        route: ResolvedRoute,
        started: float,
        slot: Slot,
        *,
        usage: UsageRole = None,
    ) -> web.StreamResponse:
        upstream = exchange.head
        stream, flow = self._new_stream(
            request, route, started, plan, upstream.status, upstream.headers, usage
        )
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in stream_response_headers(
            drop_hop_by_hop(upstream.headers.items()), drop_encoding=plan.decoded
        ):
            response.headers.add(name, value)
        _add_headers(response, flow)

        async def drive(driver: StreamDriver) -> None:
            await driver.run(exchange)

        await self._run_stream(request, response, stream, flow, slot, drive, exchange.finish)
        return response

    async def _relay_early(
        self,
        request: web.BaseRequest,
        opening: asyncio.Future[Exchange],
        route: ResolvedRoute,
        started: float,
        slot: Slot,
    ) -> web.StreamResponse:
        """Commit ``200 text/event-stream`` before the upstream answers, and keep it alive.

        Load balancers cut connections that stay silent through a long
        prefill. The stream's dialect then comes from the path alone.
        """
        committed = {"Content-Type": "text/event-stream; charset=utf-8"}
        plan = StreamPlan("sse", "identity", committed["Content-Type"])
        stream, flow = self._new_stream(request, route, started, plan, 200, committed)
        response = web.StreamResponse(status=200)
        for name, value in stream_response_headers(committed.items()):
            response.headers.add(name, value)
        _add_headers(response, flow)
        extra = self._extra_types

        def refusal(head: ResponseHead) -> str | None:
            answered = plan_response(request.method, head.status, head.headers, extra)
            if head.status < 400 and answered is not None and answered.framing == "sse":
                if answered.decoded:
                    return "the upstream answered with a compressed stream"
                return None
            kind = head.headers.get("Content-Type", "no content type")
            return f"the upstream answered HTTP {head.status} ({kind})"

        async def drive(driver: StreamDriver) -> None:
            await driver.run_early(opening, refusal)

        def settle_opening() -> None:
            if not opening.done():
                opening.cancel()
            elif not opening.cancelled() and opening.exception() is None:
                opening.result().finish()

        await self._run_stream(request, response, stream, flow, slot, drive, settle_opening)
        return response

    async def _run_stream(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        stream: ActiveStream,
        flow: PipelineStream,
        slot: Slot,
        drive: Callable[[StreamDriver], Awaitable[None]],
        release_upstream: Callable[[], None],
    ) -> None:
        """Track one stream from its head to its record, whatever ends it.

        ``release_upstream`` hands the upstream side back (pooled if whole,
        else closed) once the stream is over: when this returns, or, for a
        stream drained after its client left, when the drain ends.
        """
        relay = stream.relay
        self.tracker.open(stream)
        run = _StreamRun(self.pipeline, stream, flow, release_upstream)
        try:
            await self._stream_body(request, response, run, slot, drive)
        except asyncio.CancelledError:
            driving = run.driving
            if driving is not None and relay.draining and not driving.done():
                self._read_on(run, driving)
            else:
                run.client_left()
            raise
        except CLIENT_GONE:
            relay.client_gone(asyncio.get_running_loop().time())
            if run.driving is not None:
                run.driving.cancel()
        finally:
            if not run.in_background:
                run.conclude()

    async def _stream_body(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        run: _StreamRun,
        slot: Slot,
        drive: Callable[[StreamDriver], Awaitable[None]],
    ) -> None:
        """The stream's head, its body as the driver relays it, and its end to the client."""
        await response.prepare(request)
        channel = ClientChannel(request, response)
        run.driver = driver = _driver(channel, run.stream, run.flow)
        if run.flow.start.route.on_client_gone != "drain" and run.stream.relay.journal is None:
            # In the handler's own task: a task more per stream would be
            # memory in every open stream, and nothing outlives the client.
            await drive(driver)
        else:
            # drain and detach read the upstream on after the client left.
            # Shielded: the stream outlives the handler that aiohttp cancels
            # when the client leaves.
            run.driving = asyncio.ensure_future(drive(driver))
            await asyncio.shield(run.driving)
        # The slot goes back before the end reaches the client: it may ask
        # again the moment it has it (an agent loop does).
        slot.release()
        if not channel.closed:
            with contextlib.suppress(*CLIENT_GONE):
                await response.write_eof()

    def _read_on(self, run: _StreamRun, driving: asyncio.Future[None]) -> None:
        """Let a drained or detached stream run on past its handler, then conclude it."""
        run.in_background = True
        run.flow.counted_detached = self.pipeline.end.count_detached(run.stream.relay)
        self._draining.add(driving)
        driving.add_done_callback(self._draining.discard)
        driving.add_done_callback(lambda _: run.conclude())

    async def _pass_through(
        self, request: web.BaseRequest, exchange: Exchange, route: ResolvedRoute
    ) -> web.StreamResponse:
        upstream = exchange.head
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in drop_hop_by_hop(upstream.headers.items()):
            response.headers.add(name, value)
        copier: PassThrough | None = None
        try:
            await response.prepare(request)
            channel = ClientChannel(request, response)
            copier = PassThrough(channel, exchange, route.client_write_timeout)
            channel.on_gone(copier.client_gone)
            if await copier.run():
                with contextlib.suppress(*CLIENT_GONE):
                    await response.write_eof()
        finally:
            if copier is not None:
                copier.finish()
            else:
                exchange.finish()
        return response

    # -- the request -----------------------------------------------------------

    def _forwarded_headers(self, request: web.BaseRequest) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict(drop_hop_by_hop(request.headers.items()))
        for name in _REBUILT:
            headers.popall(name, None)
        headers["Host"] = (
            request.headers.get("Host", self.origin.host_header)
            if self.settings.preserve_host
            else self.origin.host_header
        )
        remote = request.remote or ""
        forwarded_for = request.headers.get("X-Forwarded-For")
        trusted = self._trusted(remote)
        if forwarded_for and trusted:
            headers["X-Forwarded-For"] = f"{forwarded_for}, {remote}"
        else:
            headers["X-Forwarded-For"] = remote
        if not trusted:
            # Only a trusted hop may say who the client is: from anyone else
            # these would let a client lie to an upstream that believes them.
            headers.popall("Forwarded", None)
            headers["X-Real-IP"] = remote
        headers["X-Forwarded-Proto"] = request.scheme
        headers["X-Forwarded-Host"] = request.host
        trace: RequestTrace | None = request.get(_TRACE)
        if trace is not None:
            # The upstream call's own context, so the server's spans join the trace.
            headers.popall("traceparent", None)
            headers.popall("tracestate", None)
            headers.update(trace.upstream_headers())
        if self._authorization is not None:
            headers["Authorization"] = self._authorization
        return headers

    def _trusted(self, peer: str) -> bool:
        if not self._trusted_networks or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False  # a unix-socket peer, say
        return any(address in network for network in self._trusted_networks)

    def _request_body(
        self, request: web.BaseRequest, start: bytes, rewritten: Rewritten | None = None
    ) -> RequestBody | None:
        if not request.body_exists:
            return None
        if rewritten is not None:
            return RequestBody(
                start=rewritten.body,
                rest=None,
                chunked=False,
                limit=self.settings.max_request_body_bytes,
            )
        content = request.content
        rest = None if content.at_eof() else content.iter_any()
        return RequestBody(
            start=start,
            rest=rest,
            chunked=request.content_length is None,
            limit=self.settings.max_request_body_bytes,
        )

    def _request_head(
        self,
        request: web.BaseRequest,
        body: RequestBody | None,
        rewritten: Rewritten | None = None,
        length: int | None = None,
    ) -> bytes:
        headers = self._forwarded_headers(request)
        if rewritten is not None:
            length = len(rewritten.body)
        if body is not None and body.chunked:
            headers["Transfer-Encoding"] = "chunked"
        elif length is not None:
            headers["Content-Length"] = str(length)
        elif request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        return request_head(request.method, self._prefix + request.raw_path, headers.items())


class _StreamRun:
    """One stream's part in the sidecar's handler: its driver, its task, and its end.

    The driver, and its task when the stream reads on after its client
    left (drain, detach), come as the stream goes; whatever ends it,
    :meth:`conclude` does the sidecar's own cleanup (the upstream given
    back or closed) and then the end every stream has, in both faces.
    """

    __slots__ = (
        "_pipeline",
        "_release_upstream",
        "driver",
        "driving",
        "flow",
        "in_background",
        "stream",
    )

    def __init__(
        self,
        pipeline: Pipeline[ActiveStream],
        stream: ActiveStream,
        flow: PipelineStream,
        release_upstream: Callable[[], None],
    ) -> None:
        self._pipeline = pipeline
        self.stream = stream
        self.flow = flow
        self._release_upstream = release_upstream
        self.driver: StreamDriver | None = None
        self.driving: asyncio.Future[None] | None = None
        #: The stream runs on past its handler, which must not conclude it.
        self.in_background = False

    def client_left(self) -> None:
        """aiohttp cancelled the handler: the client disconnected (or the server stops)."""
        # The driver has usually shut the upstream already, in the callback
        # that read the client's FIN.
        if self.driving is not None:
            self.driving.cancel()
        if self.driver is not None:
            self.driver.client_gone()
        self.stream.relay.client_gone(asyncio.get_running_loop().time())

    def conclude(self) -> None:
        """The stream is over: the upstream side back, then its record everywhere."""
        if self.driver is not None:
            self.driver.finish()
        self._release_upstream()  # once: Exchange.finish acts only the first time
        self._pipeline.finish(self.stream, self.flow, asyncio.get_running_loop().time())


async def _continue(request: web.BaseRequest) -> bool:
    """Answer ``Expect: 100-continue`` before the body is read; ``False`` for any other.

    The sidecar answers it itself and never forwards ``Expect``: an upstream
    that ignores the header would hold the body (and the client) forever.
    """
    if request.headers["Expect"].strip().lower() != "100-continue":
        return False
    if request.version >= aiohttp.HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response itself has not started
    return True


def _add_headers(response: web.StreamResponse, flow: PipelineStream) -> None:
    """What the stream's stages add to its head (a resumable stream's id, say)."""
    for name, value in flow.headers:
        response.headers[name] = value


def _driver(channel: ClientChannel, stream: ActiveStream, flow: PipelineStream) -> StreamDriver:
    """The stream's driver, told of its client leaving and able to stop it (a resume's stop)."""
    route = flow.start.route
    detached = stream.relay.journal is not None
    driver = StreamDriver(
        channel,
        stream,
        flow.start.plan,
        route.client_write_timeout,
        drain_on_gone=route.on_client_gone == "drain",
        detach_window=route.resume_window if detached else None,
        holds=flow.holds,
    )
    channel.on_gone(driver.client_gone)
    flow.on_stop = driver.stop
    return driver


def _buffered_response(answer: Buffered) -> web.Response:
    response = web.Response(status=answer.status, reason=answer.reason, body=answer.body)
    for name, value in answer.headers:
        response.headers.add(name, value)
    return response
