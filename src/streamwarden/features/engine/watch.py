"""A face's watch on its inference engine's ``/metrics`` (``engine_metrics_url``).

Every ``engine_scrape_interval`` it reads the engine's generated-token
counter (:mod:`streamwarden.features.engine.counters` has the table of names) and counts,
in ``streamwarden_engine_unseen_tokens_total``, the tokens the engine
generated that no stream through this face accounts for. After a
stream is cancelled it also polls the engine every 10 ms, for at most
:data:`ABORT_WATCH`, until the engine runs no more requests than the
face has open: ``streamwarden_engine_abort_seconds`` is how long the
engine took to stop, and the tokens it generated meanwhile count in
``streamwarden_engine_tokens_after_cancel_total``.

Both faces run the same watch on their own pipeline (the sidecar per
process, the middleware per instance): it sees each stream's meter as it
opens (the pipeline's ``on_open``, for the tokens of streams in flight)
and each record as the stream ends (the register's listeners). It is
handed both lists, so that it imports no pipeline: the pipeline's stages
import the features, not the other way round. A face only starts and closes it: the sidecar with its
server, the middleware at its first lifespan startup or request and in its ``close()``.

A watch that shares its engine with other watches on the host (an app's
worker processes, each with a middleware) cannot tell whose its tokens
are: while :mod:`~streamwarden.features.engine.peers` counts more than
one, it claims neither unseen tokens nor abort times
(``streamwarden_engine_watches`` says why), and once alone again it
starts a new baseline.

An engine that cannot be scraped never touches a stream: the scrape is
its own task, with its own timeout; a counter and a rate-limited log line
say so.

The scrape is a plain ``GET`` on streamwarden's own HTTP/1.1 client
(:mod:`streamwarden.net.upstream`), not aiohttp's: the middleware imports no
aiohttp, and the page is read to its end (bounded by
:data:`MAX_SCRAPE_BYTES`), where aiohttp's ``content.read(n)`` gives what
has arrived so far (the first 64 KiB of a larger page, so a counter further
down was "not there"). Redirects are not followed: point
``engine_metrics_url`` at the page itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Any

from yarl import URL

from streamwarden import __version__
from streamwarden.config import Settings
from streamwarden.core.headers import redact_url
from streamwarden.core.meter import EndState, StreamMeter, StreamRecord
from streamwarden.features.engine.counters import EngineReading, Reconciler, read_engine
from streamwarden.features.engine.peers import EngineWatchers
from streamwarden.net.upstream import (
    Origin,
    UpstreamError,
    UpstreamPool,
    open_exchange,
    request_head,
)
from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.observation.register import StreamRegister

__all__ = ["ABORT_WATCH", "EngineWatch"]

log = logging.getLogger("streamwarden.engine")

#: Longest the engine is watched after a cancel; slower counts as a timeout.
ABORT_WATCH = 5.0
#: How often the engine is read while a cancel is being watched.
ABORT_POLL = 0.01
#: Most bytes of one scrape (vLLM's full text is a few hundred KiB).
MAX_SCRAPE_BYTES = 8 * 1024 * 1024
#: How long a connection to the engine is kept between reads: reused by the
#: 10 ms polls after a cancel, and closed before the engine's own idle
#: timeout (uvicorn's, under vLLM and SGLang, is 5 s) can race a request.
_KEEPALIVE = 2.0
#: The answers that are a metrics page: Prometheus text, OpenMetrics, or unsaid.
_PAGE_TYPES = frozenset({"text/plain", "application/openmetrics-text", ""})
_CANCELLED = frozenset(
    {EndState.CLIENT_CANCELLED, EndState.DETACHED_EXPIRED, EndState.CLIENT_TOO_SLOW}
)


class EngineWatch:
    """Scrapes the engine, reconciles its tokens, and times its aborts."""

    def __init__(
        self,
        settings: Settings,
        register: StreamRegister[Any],
        on_open: list[Callable[[StreamMeter], None]],
        metrics: StreamMetrics,
    ) -> None:
        assert settings.engine_metrics_url is not None
        self.url = settings.engine_metrics_url
        self._shown = redact_url(self.url)
        self.engine = settings.engine
        self.interval = settings.engine_scrape_interval
        self._register = register
        self._metrics = metrics
        self._reconciler = Reconciler()
        self._finished_tokens = 0.0
        #: The meters of the streams in flight (by identity: a record carries
        #: its stream's meter, so the stream's end finds it again).
        self._open: dict[int, StreamMeter] = {}
        self._cancels: list[float] = []
        self._timeout = max(1.0, min(self.interval, 10.0))
        url = URL(self.url)
        assert url.host is not None and url.port is not None  # the config checked it
        self._origin = Origin(url.scheme, url.host, url.port)
        self._head = _request_head(url, self._origin)
        self._pool: UpstreamPool | None = None
        self._scraping: asyncio.Task[None] | None = None
        self._aborts: asyncio.Task[None] | None = None
        self._warnings = RateLimitedWarnings(60.0, log)
        self._watchers = EngineWatchers(self.url)
        #: No other watch of the engine was alive at the last count (the
        #: reconciliation's window needs this one alone at both of its ends).
        self._alone = True
        on_open.append(self._stream_opened)
        self._register.listeners.append(self._stream_finished)

    async def start(self) -> None:
        """Scrape from now on (in a task of the running loop)."""
        # Before this face serves a stream: whoever counts the watches after
        # reading the engine finds this one if any of its tokens are in the reading.
        self._watchers.join()
        self._alone = self._watchers.count() == 1
        https = self._origin.scheme == "https"
        self._pool = UpstreamPool(
            self._origin,
            connect_timeout=self._timeout,
            keepalive_timeout=_KEEPALIVE,
            max_idle=2,  # the scrape and an abort's polls may overlap
            ssl_context=ssl.create_default_context() if https else None,
        )
        self._scraping = asyncio.create_task(self._scrape_forever(), name="streamwarden-engine")

    async def close(self) -> None:
        """Stop scraping and timing aborts, and close the connections to the engine."""
        for task in (self._scraping, self._aborts):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._pool is not None:
            await self._pool.close()
        self._watchers.leave()

    @property
    def running(self) -> bool:
        """Started, and not closed."""
        return self._scraping is not None and not self._scraping.done()

    def seen(self) -> float:
        """Tokens this face saw generated: finished streams, and those in flight."""
        active = sum(meter.tokens_generated for meter in self._open.values())
        return self._finished_tokens + active

    async def read(self) -> EngineReading | None:
        """One scrape of the engine, or ``None`` (counted and logged) if it failed."""
        assert self._pool is not None
        try:
            async with asyncio.timeout(self._timeout):
                body = await self._get(self._pool)
        except TimeoutError:
            self._failed(f"no answer within {self._timeout:g} s")
            return None
        except (UpstreamError, _NotAPage) as exc:
            self._failed(str(exc))
            return None
        reading = read_engine(body.decode("utf-8", "replace"), self.engine)
        if reading is None:
            self._failed("no generated-token counter of a known engine")
        return reading

    async def _get(self, pool: UpstreamPool) -> bytes:
        """The page, whole; :class:`_NotAPage` if the answer is not one."""
        exchange = await open_exchange(
            pool, self._head, None, head_only=False, headers_timeout=0.0, idempotent=True
        )
        try:
            head = exchange.head
            media_type = head.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if head.status != 200:
                raise _NotAPage(f"HTTP {head.status}")
            if media_type not in _PAGE_TYPES:
                # Not read to its end: the wrong path of a model server may be a stream.
                raise _NotAPage(f"HTTP 200 but {media_type}, not Prometheus text")
            page = _Page(MAX_SCRAPE_BYTES)
            exchange.attach(page)
            await page.read
            if page.too_large:
                raise _NotAPage(f"over {MAX_SCRAPE_BYTES} bytes")
            return page.content()
        finally:
            exchange.finish()  # a page not read whole: the connection is closed

    def _failed(self, why: str) -> None:
        self._metrics.engine_scrape_errors.inc()
        self._warnings.warn("engine", "engine metrics %s: %s", self._shown, why)
        return None

    async def _scrape_forever(self) -> None:
        while True:
            reading = await self.read()
            # Counted after the reading: a watch joins before its first stream.
            was_alone, self._alone = self._alone, self._count_watches() == 1
            if reading is not None:
                if was_alone and self._alone:
                    generated, unseen = self._reconciler.update(reading, self.seen())
                    self._metrics.engine_unseen.inc(unseen)
                else:  # some of these tokens may be another watch's
                    generated = self._reconciler.rebase(reading, self.seen())
                self._metrics.engine_generated.inc(generated)
            await asyncio.sleep(self.interval)  # the scrape interval, not a wait for a condition

    def _count_watches(self) -> int:
        """The watches of this engine now (the gauge shows the count at the last scrape)."""
        watches = self._watchers.count()
        self._metrics.engine_watches.set(watches)
        return watches

    # -- aborts --------------------------------------------------------------

    def _stream_opened(self, meter: StreamMeter) -> None:
        self._open[id(meter)] = meter

    def _stream_finished(self, record: StreamRecord) -> None:
        meter = record.meter
        self._open.pop(id(meter), None)
        self._finished_tokens += meter.tokens_generated
        # Shared, the engine runs the other watches' requests too: no stop to time.
        if meter.end_state in _CANCELLED and self.running and self._alone:
            self._cancels.append(asyncio.get_running_loop().time())
            if self._aborts is None or self._aborts.done():
                self._aborts = asyncio.get_running_loop().create_task(
                    self._time_aborts(), name="streamwarden-engine-aborts"
                )

    async def _time_aborts(self) -> None:
        """Until the engine runs no more requests than the face has open."""
        loop = asyncio.get_running_loop()
        start = await self.read()
        seen_at_start = self.seen()
        while self._cancels:
            if not self._alone:  # another watch joined: its requests run there too
                self._cancels.clear()
                return
            first = self._cancels[0]
            reading = await self.read()
            now = loop.time()
            if (
                reading is not None
                and reading.running is not None
                and reading.running <= len(self._register.active)
            ):
                for cancelled_at in self._cancels:
                    self._metrics.engine_abort.observe(now - cancelled_at)
                self._cancels.clear()
                if start is not None and reading.engine == start.engine:
                    engine_more = reading.generated - start.generated
                    seen_more = self.seen() - seen_at_start
                    self._metrics.engine_after_cancel.inc(max(0.0, engine_more - seen_more))
                return
            if now - first > ABORT_WATCH:
                self._metrics.engine_abort_timeouts.inc(len(self._cancels))
                self._cancels.clear()
                return
            await asyncio.sleep(ABORT_POLL)  # the poll interval of the engine's gauge


def _request_head(url: URL, origin: Origin) -> bytes:
    """The scrape's request: credentials in the URL go as Basic auth, as Prometheus sends them."""
    headers = [
        ("Host", origin.host_header),
        ("User-Agent", f"streamwarden/{__version__}"),
        # Prometheus's text format; no Accept-Encoding: the page comes uncompressed.
        ("Accept", "text/plain"),
    ]
    if url.user is not None:
        token = f"{url.user}:{url.password or ''}".encode()
        headers.append(("Authorization", "Basic " + base64.b64encode(token).decode()))
    target = url.raw_path or "/"
    if url.raw_query_string:
        target += "?" + url.raw_query_string
    return request_head("GET", target, headers)


class _NotAPage(Exception):
    """The engine answered, but not with a metrics page (the message says what it was)."""


class _Page:
    """A ``BodySink`` that keeps a page whole, up to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self.too_large = False
        #: Done when the page ended, broke, or went over the limit.
        self.read: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def body(self, chunk: bytes) -> None:
        if self.read.done():
            return
        self._size += len(chunk)
        if self._size > self._limit:
            self.too_large = True
            self._chunks = []
            self.read.set_result(None)
            return
        self._chunks.append(chunk)

    def read_done(self) -> None:
        pass

    def body_end(self) -> None:
        if not self.read.done():
            self.read.set_result(None)

    def body_broken(self, error: UpstreamError) -> None:
        if not self.read.done():
            self.read.set_exception(error)

    def content(self) -> bytes:
        return b"".join(self._chunks)
