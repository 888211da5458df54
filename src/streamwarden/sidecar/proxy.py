"""The proxy handler: forwards every request to the one upstream, relays streams.

This module routes a request and wires the pieces together; each has a
module of its own:

- what the upstream gets of the request (headers, head, body, ``Expect``,
  trusted hops): :mod:`~streamwarden.sidecar.forwarding`;
- what is done with a request before anything of it is forwarded (a
  resume or an owner's stop answered from the store, the request's spans,
  usage injection's rewrite, the ``max_concurrent_streams`` slot): the
  pipeline's request step (:mod:`streamwarden.pipeline.step`), whose
  answers :mod:`~streamwarden.sidecar.resume` writes;
- an upstream's ``400`` to a rewritten request: :mod:`~streamwarden.sidecar.injection`;
- the upstream client: :mod:`~streamwarden.net.upstream`;
- what the upstream answers, as the response's stream plan
  (:mod:`streamwarden.core.plan`) decides: a stream goes through
  :mod:`~streamwarden.sidecar.streaming` (and, before the upstream answers
  on a route with early headers, :mod:`~streamwarden.sidecar.early`);
  anything else is copied byte for byte by
  :mod:`~streamwarden.sidecar.passthrough`; WebSocket upgrades are
  :mod:`~streamwarden.sidecar.websocket`'s.

Every decision about a stream is the relay's. The aiohttp server runs with
``handler_cancellation=True`` and the driver hears of a client that leaves
in the callback that read its FIN, so the upstream connection is shut at
once, even while the upstream is silent: that is what makes an inference
server stop generating. Before any response started, an upstream failure
is a plain HTTP error, from one map (:func:`_refusal_for`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.headers import redact, redact_url
from streamwarden.core.plan import plan_response
from streamwarden.core.refusals import RefusalKind
from streamwarden.core.usage import UsageRole
from streamwarden.net.upstream import (
    BodyTooLarge,
    ClientBodyBroken,
    Exchange,
    HeadTimeout,
    RequestBody,
    UpstreamError,
    UpstreamPool,
    open_exchange,
)
from streamwarden.observation.register import Slot
from streamwarden.pipeline.request import Answer, IncomingRequest, Rewrite, Serve
from streamwarden.pipeline.services import Services
from streamwarden.sidecar.early import relay_early
from streamwarden.sidecar.forwarding import TRACE, Forwarding, describe, idempotent
from streamwarden.sidecar.http import refuse
from streamwarden.sidecar.injection import look_into_refusal
from streamwarden.sidecar.passthrough import pass_through
from streamwarden.sidecar.resume import answered, serve
from streamwarden.sidecar.streaming import Streaming
from streamwarden.sidecar.streams import ActiveStream, StreamTracker
from streamwarden.sidecar.websocket import SessionListener, WebSocketRelay, is_websocket

__all__ = ["Proxy"]

log = logging.getLogger("streamwarden.proxy")


class Proxy:
    """The reverse proxy; one per process, sharing one upstream connection pool."""

    def __init__(
        self,
        settings: Settings,
        tracker: StreamTracker,
        services: Services[ActiveStream],
        websocket_listener: SessionListener | None = None,
    ) -> None:
        #: How requests reach the upstream (a ValueError without one): its
        #: address, its credentials, the hops trusted.
        self.forwarding = Forwarding(settings)
        self.origin = self.forwarding.origin
        self.settings = settings
        self.tracker = tracker
        self._websocket_listener = websocket_listener
        self._extra_types = frozenset(t.lower() for t in settings.stream_media_types)
        self.pool: UpstreamPool | None = None
        self._websockets: WebSocketRelay | None = None
        #: OpenTelemetry spans and GenAI metrics (otel_exporter), or None.
        self.telemetry = services.telemetry
        #: Resumes and stops, when some route keeps its streams for a resume.
        self.resume = services.resume
        #: What runs on every stream, and where every stream ends.
        self.pipeline = services.pipeline
        #: What is done with each request before anything of it is forwarded.
        self.step = services.pipeline.step
        #: The streams, from their head to their record.
        self.streaming = Streaming(self.pipeline, tracker)

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
            connector, settings.keepalive_interval, self._websocket_listener, self.streaming
        )

    async def close(self) -> None:
        await self.streaming.close()
        if self._websockets is not None:
            await self._websockets.close()
            self._websockets = None
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    # -- the handler -----------------------------------------------------------

    @property
    def handler(self) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        """The request handler: traced when telemetry is on, else without the wrapper
        (one coroutine less per request: its frame is part of every idle stream's memory)."""
        return self._handle if self.telemetry is None else self.handle

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The handler, with the request's OpenTelemetry spans around it."""
        incoming = describe(request, self.step.route(request.path))
        trace = self.step.traced(incoming)
        if trace is None:  # no stage of the plan traces requests
            return await self._handle(request, incoming)
        request[TRACE] = trace
        try:
            response = await self._handle(request, incoming)
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

    async def _handle(
        self, request: web.BaseRequest, incoming: IncomingRequest | None = None
    ) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        refused = self._refused(request)
        if refused is not None:
            return refused
        if is_websocket(request):
            assert self._websockets is not None
            url = self.forwarding.websocket_url(request)
            route = incoming.route if incoming is not None else self.step.route(request.path)
            headers = self.forwarding.headers(request)
            return await self._websockets.relay(request, url, headers, route)
        if incoming is None:
            incoming = describe(request, self.step.route(request.path))
        route = incoming.route
        decision = await self.step.decide(incoming)
        if isinstance(decision, Answer):
            return answered(decision)
        if isinstance(decision, Serve):
            return await serve(request, decision)
        wants_stream = decision.asks_for_stream
        rewritten = decision.rewritten
        body = self.forwarding.body(request, decision.body_start, rewritten)
        head = self.forwarding.head(request, body, rewritten)
        slot = decision.slot
        forward = self._forward(
            request,
            head,
            body,
            route,
            started,
            slot,
            early=wants_stream and route.early_headers_after > 0,
            rewritten=rewritten,
            usage=decision.usage,
        )
        # This frame lives as long as the stream: what was only for the
        # request (its head and body) is the forwarding's to let go of.
        del head, body, rewritten, decision, incoming
        try:
            return await forward
        finally:
            slot.release()

    def _refused(self, request: web.BaseRequest) -> web.Response | None:
        """The refusal of a request that must not reach the upstream at all, or ``None``."""
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
        return None

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
        rewritten: Rewrite | None = None,
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
                    return await relay_early(
                        self.streaming, request, opening, route, started, slot, self._extra_types
                    )
                exchange = opening.result()
            else:
                # In this task: a task of its own would stay, done, for the stream.
                exchange = await self._exchange(request, head, body)
            if rewritten is not None and exchange.head.status == 400:
                refusal = await look_into_refusal(exchange, rewritten)
                if refusal is not None:
                    return refusal.response()
                original = self.forwarding.whole_body(rewritten.original)
                length = len(rewritten.original)
                head = self.forwarding.head(request, original, None, length)
                exchange, usage = await self._exchange(request, head, original), None
        except asyncio.CancelledError:
            if opening is not None:
                opening.cancel()
            raise
        except UpstreamError as exc:
            return _refusal_for(exc, self.settings)
        del head, body, rewritten  # sent: not for an idle stream to hold
        plan = plan_response(
            request.method, exchange.head.status, exchange.head.headers, self._extra_types
        )
        if plan is None:
            slot.release()  # not a stream, whatever the request asked for
            return await pass_through(request, exchange, route)
        return await self.streaming.relay(
            request, exchange, plan, route, started, slot, usage=usage
        )

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
            idempotent=idempotent(request),
        )


def _refusal_for(exc: UpstreamError, settings: Settings) -> web.Response:
    """The error to answer before any response started: one map, for every failure."""
    if isinstance(exc, BodyTooLarge):
        return refuse(RefusalKind.REQUEST_TOO_LARGE, limit=settings.max_request_body_bytes)
    if isinstance(exc, ClientBodyBroken):
        return refuse(RefusalKind.REQUEST_BODY_INCOMPLETE)
    if isinstance(exc, HeadTimeout):
        return refuse(RefusalKind.UPSTREAM_TIMEOUT)
    # The error's own words name no header value and no URL query.
    log.warning(
        "upstream %s: %s: %s",
        redact_url(settings.upstream or ""),
        type(exc).__name__,
        exc,
    )
    # Refused, reset, or not HTTP: to the client, all of it is "unreachable".
    return refuse(RefusalKind.UPSTREAM_UNREACHABLE)
