"""The sidecar process: proxy and admin listeners, and graceful drain.

Two listeners, never mixed: the proxy port forwards everything (it has no
routes of its own, so ``/metrics`` there goes to the upstream like any other
path) and the admin port serves ``/metrics``, ``/healthz`` and ``/readyz``
and never proxies.

Drain (on SIGTERM, SIGINT or SIGHUP, or :meth:`Sidecar.drain`): ``/readyz`` answers 503 at
once, the proxy listener stops accepting connections, streams in flight run
on for up to ``drain_timeout``; those still open then get the dialect's
``shutting_down`` error event and a clean end, and their upstreams are
closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from aiohttp import web
from yarl import URL

from streamwarden._native import native_summary
from streamwarden.config import Settings
from streamwarden.core.headers import redact_url
from streamwarden.observation.live import recent_endings, stream_view
from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.observation.metrics import CONTENT_TYPE_LATEST
from streamwarden.pipeline.services import Services
from streamwarden.sidecar.descriptors import (
    PROXY_BACKLOG,
    client_connection_budget,
    open_files_limit,
    raise_open_files_limit,
)
from streamwarden.sidecar.http import ClientConnections, GuardedServer
from streamwarden.sidecar.proxy import Proxy
from streamwarden.sidecar.streams import ActiveStream, StreamTracker

__all__ = ["Sidecar", "run_sidecar"]

log = logging.getLogger("streamwarden.sidecar")

# After drain_timeout, how long the streams get to write their error event.
_FINAL_WRITE_GRACE = 1.0


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Sidecar:
    """One running sidecar: start it, read its ports, drain it, close it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.tracker = StreamTracker()
        #: Metrics, resumes, telemetry, the pipeline, the engine watch: as the settings say.
        self.services: Services[ActiveStream] = Services("sidecar", settings, self.tracker)
        self.metrics = self.services.metrics
        self.proxy = Proxy(
            settings,
            self.tracker,
            self.services,
            websocket_listener=self.metrics.websocket_session,
        )
        #: The inference engine's counters against the sidecar's (engine_metrics_url).
        self.engine_watch = self.services.engine_watch
        self.draining = False
        self._proxy_runner: web.BaseRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._proxy_site: web.TCPSite | None = None
        #: The proxy port's open client connections (after :meth:`start`).
        self.client_connections = ClientConnections(0)
        self.proxy_port = 0
        self.admin_port = 0

    @property
    def proxy_url(self) -> str:
        """``http://HOST:PORT`` of the proxy listener (after :meth:`start`)."""
        host, _ = _split(self.settings.listen)
        return f"http://{_url_host(host)}:{self.proxy_port}"

    @property
    def admin_url(self) -> str:
        host, _ = _split(self.settings.admin_listen)
        return f"http://{_url_host(host)}:{self.admin_port}"

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream pool, then the admin port, then the proxy port.

        If any of it fails (a port in use), what was opened is closed again.
        """
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        await self.proxy.start()
        await self.services.start()
        admin = web.Application()
        admin.router.add_get("/metrics", self._metrics)
        admin.router.add_get("/healthz", self._healthz)
        admin.router.add_get("/readyz", self._readyz)
        admin.router.add_get("/streams", self._streams)
        self._admin_runner = web.AppRunner(admin, access_log=None, shutdown_timeout=1.0)
        await self._admin_runner.setup()
        host, port = _split(self.settings.admin_listen)
        admin_site = web.TCPSite(self._admin_runner, host, port, reuse_address=True)
        await admin_site.start()
        self.admin_port = _bound_port(self._admin_runner)

        settings = self.settings
        connections = ClientConnections(self._client_connection_limit())
        self.client_connections = connections
        self.proxy.streaming.places = connections
        self.metrics.watch_client_connections(lambda: connections.held, connections.limit)
        proxy_server = GuardedServer(
            self.proxy.handler,
            handler_cancellation=True,
            access_log=None,
            max_line_size=settings.max_request_line_bytes,
            max_field_size=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_deadline=settings.request_header_timeout,
            connections=connections,
            on_refused=self.metrics.connection_refused,
            warnings=RateLimitedWarnings(),
        )
        self._proxy_runner = web.ServerRunner(proxy_server, shutdown_timeout=_FINAL_WRITE_GRACE)
        await self._proxy_runner.setup()
        host, port = _split(self.settings.listen)
        self._proxy_site = web.TCPSite(
            self._proxy_runner, host, port, reuse_address=True, backlog=PROXY_BACKLOG
        )
        await self._proxy_site.start()
        self.proxy_port = _bound_port(self._proxy_runner)

    def _client_connection_limit(self) -> int:
        """``max_client_connections``, or what the open-files limit fits (a warning if less)."""
        settings = self.settings
        fits = client_connection_budget(open_files_limit(), settings.upstream_pool_size)
        if settings.max_client_connections == 0:
            return fits
        if settings.max_client_connections > fits:
            log.warning(
                "max_client_connections %d is more than the open-files limit %d fits (%d):"
                " past that, the admin port and new upstream connections can fail",
                settings.max_client_connections,
                open_files_limit(),
                fits,
            )
        return settings.max_client_connections

    async def drain(self) -> None:
        """Stop taking connections, let streams finish, then end the rest honestly."""
        if self.draining:
            return
        self.draining = True
        if self._proxy_site is not None:
            await self._proxy_site.stop()
        timeout = self.settings.drain_timeout
        loop = asyncio.get_running_loop()
        # Each stream's relay ends it with shutting_down once this passes
        # (streams that open meanwhile, on kept-alive connections, too).
        self.tracker.drain_by(loop.time() + (timeout if timeout > 0 else 0.0))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0) + _FINAL_WRITE_GRACE):
                await self.tracker.wait_idle()

    async def close(self) -> None:
        if self._proxy_runner is not None:
            await self._proxy_runner.cleanup()
            self._proxy_runner = None
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        await self.proxy.close()
        # After the streams: their ends are written to the resume store.
        await self.services.close()

    # -- admin -----------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _streams(self, request: web.Request) -> web.Response:
        """The open streams, oldest first, and how the last minute's ended (streamwarden top)."""
        now = asyncio.get_running_loop().time()
        active = sorted(self.tracker.active, key=lambda s: s.relay.meter.started_at)
        return web.json_response(
            {
                "streams": [
                    stream_view(s.stream_id, s.route, s.relay, now, s.paused) for s in active
                ],
                "recent": recent_endings(self.tracker.finished, now),
                "draining": self.draining,
            }
        )

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if self.settings.readiness_check_upstream and not await self._upstream_reachable():
            return web.json_response({"status": "upstream unreachable"}, status=503)
        return web.json_response({"status": "ready"})

    async def _upstream_reachable(self) -> bool:
        """Whether a connection to the upstream opens within the connect timeout."""
        upstream = self.settings.upstream or ""
        limit = min(self.settings.upstream_connect_timeout or 2.0, 2.0)
        try:
            async with asyncio.timeout(limit):
                if upstream.startswith("unix:"):
                    _, writer = await asyncio.open_unix_connection(upstream[len("unix:") :])
                else:
                    url = URL(upstream)
                    _, writer = await asyncio.open_connection(url.host, url.port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        return True


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _bound_port(runner: web.BaseRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    return 0


async def run_sidecar(settings: Settings) -> int:
    """Run until SIGTERM, SIGINT or SIGHUP, drain, and return the exit code."""
    sidecar = Sidecar(settings)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            # A second signal means "now": skip the rest of the drain.
            log.warning("second signal: exiting at once")
            os._exit(0)
        stop.set()

    # Before the listeners open: a SIGTERM that lands the moment the port
    # accepts (a fast rollout) must drain, not kill. SIGHUP too: a terminal
    # that closes, or a supervisor's reload signal, must not kill the
    # process with streams cut mid-event. Reloading the config in place is
    # not done: listeners, pool and limits are fixed at start, so a
    # restart (drained) is the honest way to apply a new one.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)
    # The process's, so here and not in Sidecar (which tests run in their own).
    open_files = raise_open_files_limit()
    await sidecar.start()
    log.info(
        "streamwarden listening on %s (admin %s), upstream %s, event loop %s",
        settings.listen,
        settings.admin_listen,
        redact_url(settings.upstream or ""),
        type(loop).__module__.partition(".")[0],  # asyncio or uvloop
    )
    log.info(
        "streamwarden takes at most %d client connections (open-files limit %d)",
        sidecar.client_connections.limit,
        open_files,
    )
    log.info("streamwarden runs %s", native_summary())
    await stop.wait()
    log.info("draining for up to %gs", settings.drain_timeout)
    await sidecar.drain()
    await sidecar.close()
    return 0
