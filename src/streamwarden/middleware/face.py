"""The middleware face: :class:`StreamWardenMiddleware` and its metrics endpoint.

``__init__`` only loads the settings (keyword options over
``STREAMWARDEN_*`` over the defaults, the same model as the sidecar's) and
builds the instance's metrics and stream log; each HTTP request gets a
fresh :class:`~streamwarden.middleware.responder.StreamResponder`, and
each WebSocket session that carries streams (the Responses API's, by the
sidecar's rule) a :class:`~streamwarden.middleware.websocket.MessageStreams`.
Other scopes (lifespan, other WebSockets) pass straight through; the
middleware only listens to the lifespan's messages, to start and stop what runs in the
background (the engine watch, the resume store, the telemetry's exporters).
Stopping is :meth:`StreamWardenMiddleware.close`, one path whether the
lifespan's shutdown calls it or, on a server that runs no lifespan, the
program that ran the server.

Metrics. Each instance owns one :class:`~streamwarden.observation.metrics.StreamMetrics`
(its own registry, as each sidecar does). The app can expose it with one
call, ``mount_metrics(app)``, or the middleware serves it itself at
``metrics_path`` when that is set. Starlette builds its middleware stack
lazily, so the app cannot hold the instance when it declares its routes:
the middleware puts itself in every HTTP scope under ``"streamwarden"``,
and the endpoint renders the metrics of whichever instance it finds there.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from streamwarden.config import SIDECAR_ONLY, load_settings
from streamwarden.core.messages import carries_streams
from streamwarden.middleware._asgi import ASGIApp, Message, Receive, Scope, Send
from streamwarden.middleware.responder import StreamResponder
from streamwarden.middleware.streams import FaceContext, Streams
from streamwarden.middleware.websocket import MessageStreams
from streamwarden.observation.logs import log_unless_configured
from streamwarden.observation.metrics import CONTENT_TYPE_LATEST, StreamMetrics
from streamwarden.pipeline.services import Services

log = logging.getLogger("streamwarden.middleware")

__all__ = ["SCOPE_KEY", "MetricsEndpoint", "StreamWardenMiddleware", "mount_metrics"]

#: The scope key under which the middleware makes itself known to the app.
SCOPE_KEY = "streamwarden"


class StreamWardenMiddleware:
    """Keeps an ASGI app's streamed responses alive and honest, as the sidecar does.

    ``app.add_middleware(StreamWardenMiddleware)`` needs no options; any
    config key can be given as one (``keepalive_interval=1.0`` or ``"1s"``).
    A bad option raises :class:`~streamwarden.config.ConfigError` here.
    """

    # ``app`` is positional-only: with a ``**options`` signature, type checkers
    # match Starlette's add_middleware factory protocol only that way.
    def __init__(self, app: ASGIApp, /, **options: Any) -> None:
        self.app = app
        self.settings = load_settings(overrides=options)
        # The app's process, the app's logging: see log_unless_configured for the rule.
        log_unless_configured(self.settings)
        # Every key is accepted (one config model, one file for both faces),
        # but one that would do nothing here is said so, once, not ignored.
        for key in sorted(SIDECAR_ONLY.intersection(options)):
            log.warning("%s: a sidecar-only setting; StreamWardenMiddleware does not use it", key)
        #: Streams in flight and the recently finished ones.
        self.streams = Streams()
        #: Metrics, resumes, telemetry, the pipeline, the engine watch: as the settings say.
        self.services: Services[object] = Services("middleware", self.settings, self.streams)
        self.metrics = self.services.metrics
        #: Resumes and stops (``on_client_gone: detach``), answered before the app
        #: (by the pipeline's request step).
        self.resume = self.services.resume
        #: OpenTelemetry (otel_exporter): the otel extra, imported only when asked for.
        self.telemetry = self.services.telemetry
        self._context = FaceContext(
            settings=self.settings,
            streams=self.streams,
            pipeline=self.services.pipeline,
            extra_media_types=frozenset(t.lower() for t in self.settings.stream_media_types),
        )
        self._metrics_path = self.settings.metrics_path
        #: The inference engine's counters against this instance's streams
        #: (engine_metrics_url): started by the lifespan's startup, or by the
        #: first request when the server runs no lifespan; stopped by close().
        self.engine_watch = self.services.engine_watch
        #: The watch is still to be started (a close before any start cancels it).
        self._engine_watch_pending = self.engine_watch is not None
        #: Something to start or stop with the lifespan (else it passes untouched).
        self._runs_beside_the_app = self.services.run_beside
        #: What :meth:`close` does, once, whoever calls it first.
        self._closing: asyncio.Future[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self._runs_beside_the_app:
                receive = self._following_lifespan(receive)
            elif scope["type"] == "websocket":
                path = scope.get("path") or "/"
                route = self._context.pipeline.step.route(path)
                if carries_streams(route.dialect, path):  # the Responses API's: streams
                    streams = MessageStreams(self._context, route, scope, receive, send)
                    await streams.run(self.app)
                    return
            await self.app(scope, receive, send)
            return
        if self._engine_watch_pending:
            await self._start_engine_watch()  # a server that runs no lifespan
        scope[SCOPE_KEY] = self
        if self._metrics_path is not None and scope.get("path") == self._metrics_path:
            await _serve_metrics(self.metrics, scope, send)
            return
        # Resumes and stops are answered from the store, never by the app: the
        # responder's request step.
        await StreamResponder(self._context, scope, receive, send).run(self.app)

    def _following_lifespan(self, receive: Receive) -> Receive:
        """The app's lifespan receive, with what the middleware runs beside the app.

        Startup starts the engine watch; shutdown is :meth:`close`; each
        before the app hears of it.
        """

        async def watched() -> Message:
            message = await receive()
            kind = message.get("type")
            if kind == "lifespan.startup" and self._engine_watch_pending:
                await self._start_engine_watch()
            elif kind == "lifespan.shutdown":
                await self.close()
            return message

        return watched

    async def _start_engine_watch(self) -> None:
        """Start the engine watch once, in the loop that serves the app."""
        if self._engine_watch_pending and self.engine_watch is not None:
            self._engine_watch_pending = False
            await self.engine_watch.start()

    async def close(self) -> None:
        """Stop everything the middleware started beside the app, and wait until it has.

        That is the engine watch (its scrape and abort tasks, its connections
        to the engine), the resume store's connection and tasks, and the
        telemetry's exporters (flushed, for at most 2 s). The lifespan's
        shutdown calls it; on a server that runs no lifespan (uvicorn
        ``--lifespan off``, an ASGI test client), await it once the server
        has stopped serving, in the loop that served the app. Closing again
        does nothing; a request after it is served, but restarts nothing.
        """
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._stop_services())
        # Shielded: a caller cancelled while waiting must not stop the close half-way.
        await asyncio.shield(self._closing)

    async def _stop_services(self) -> None:
        self._engine_watch_pending = False  # closed: no later request starts it
        await self.services.close()


class MetricsEndpoint:
    """An ASGI endpoint serving the metrics of the StreamWardenMiddleware in front of it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        middleware = scope.get(SCOPE_KEY)
        if not isinstance(middleware, StreamWardenMiddleware):
            body = b"streamwarden: no StreamWardenMiddleware in front of this endpoint\n"
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await _serve_metrics(middleware.metrics, scope, send)


class _Routable(Protocol):
    def add_route(
        self,
        path: str,
        route: Any,
        methods: list[str] | None = ...,
        name: str | None = ...,
        include_in_schema: bool = ...,
    ) -> None: ...


def mount_metrics(app: _Routable, path: str = "/metrics") -> None:
    """Serve the middleware's Prometheus metrics at ``path`` of a Starlette or FastAPI app."""
    app.add_route(path, MetricsEndpoint(), methods=["GET"], include_in_schema=False)


async def _serve_metrics(metrics: StreamMetrics, scope: Scope, send: Send) -> None:
    method = scope.get("method", "GET")
    if method not in ("GET", "HEAD"):
        await send(
            {
                "type": "http.response.start",
                "status": 405,
                "headers": [(b"allow", b"GET, HEAD"), (b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})
        return
    body = metrics.render()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", CONTENT_TYPE_LATEST.encode("latin-1")),
                (b"content-length", str(len(body)).encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
