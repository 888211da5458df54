"""A face's watch on its inference engine's ``/metrics`` (``engine_metrics_url``).

Every ``engine_scrape_interval`` it reads the engine's generated-token
counter (:mod:`streamwarden.engine` has the table of names) and counts,
in ``streamwarden_engine_unseen_tokens_total``, the tokens the engine
generated that no stream through this face accounts for. After a
stream is cancelled it also polls the engine every 10 ms, for at most
:data:`ABORT_WATCH`, until the engine runs no more requests than the
face has open: ``streamwarden_engine_abort_seconds`` is how long the
engine took to stop, and the tokens it generated meanwhile count in
``streamwarden_engine_tokens_after_cancel_total``.

Both faces run the same watch on their own pipeline (the sidecar per
process, the middleware per instance): it sees each stream open
(:attr:`~streamwarden.pipeline.Pipeline.on_open`, for the tokens of
streams in flight) and each record as the stream ends (the register's
listeners). A face only starts and closes it: the sidecar with its
server, the middleware with the app's lifespan.

An engine that cannot be scraped never touches a stream: the scrape is
its own task, with its own timeout; a counter and a rate-limited log line
say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp

from streamwarden.config import Settings
from streamwarden.engine import EngineReading, Reconciler, read_engine
from streamwarden.headers import redact_url
from streamwarden.logs import RateLimitedWarnings
from streamwarden.meter import EndState, StreamMeter, StreamRecord
from streamwarden.metrics import StreamMetrics
from streamwarden.pipeline import Pipeline, PipelineStream

__all__ = ["ABORT_WATCH", "EngineWatch"]

log = logging.getLogger("streamwarden.engine")

#: Longest the engine is watched after a cancel; slower counts as a timeout.
ABORT_WATCH = 5.0
#: How often the engine is read while a cancel is being watched.
ABORT_POLL = 0.01
#: Most bytes of one scrape (vLLM's full text is a few hundred KiB).
MAX_SCRAPE_BYTES = 8 * 1024 * 1024
_CANCELLED = frozenset(
    {EndState.CLIENT_CANCELLED, EndState.DETACHED_EXPIRED, EndState.CLIENT_TOO_SLOW}
)


class EngineWatch:
    """Scrapes the engine, reconciles its tokens, and times its aborts."""

    def __init__(self, settings: Settings, pipeline: Pipeline[Any], metrics: StreamMetrics) -> None:
        assert settings.engine_metrics_url is not None
        self.url = settings.engine_metrics_url
        self._shown = redact_url(self.url)
        self.engine = settings.engine
        self.interval = settings.engine_scrape_interval
        self._register = pipeline.register
        self._metrics = metrics
        self._reconciler = Reconciler()
        self._finished_tokens = 0.0
        #: The meters of the streams in flight (by identity: a record carries
        #: its stream's meter, so the stream's end finds it again).
        self._open: dict[int, StreamMeter] = {}
        self._cancels: list[float] = []
        self._session: aiohttp.ClientSession | None = None
        self._scraping: asyncio.Task[None] | None = None
        self._aborts: asyncio.Task[None] | None = None
        self._warnings = RateLimitedWarnings(60.0, log)
        pipeline.on_open.append(self._stream_opened)
        self._register.listeners.append(self._stream_finished)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(1.0, min(self.interval, 10.0)))
        )
        self._scraping = asyncio.create_task(self._scrape_forever(), name="streamwarden-engine")

    async def close(self) -> None:
        for task in (self._scraping, self._aborts):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._session is not None:
            await self._session.close()

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
        assert self._session is not None
        try:
            async with self._session.get(self.url) as response:
                body = await response.content.read(MAX_SCRAPE_BYTES + 1)
                if response.status != 200 or len(body) > MAX_SCRAPE_BYTES:
                    self._failed(f"HTTP {response.status} ({len(body)} bytes)")
                    return None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._failed(type(exc).__name__)
            return None
        reading = read_engine(body.decode("utf-8", "replace"), self.engine)
        if reading is None:
            self._failed("no generated-token counter of a known engine")
        return reading

    def _failed(self, why: str) -> None:
        self._metrics.engine_scrape_errors.inc()
        self._warnings.warn("engine", "engine metrics %s: %s", self._shown, why)
        return None

    async def _scrape_forever(self) -> None:
        while True:
            reading = await self.read()
            if reading is not None:
                generated, unseen = self._reconciler.update(reading, self.seen())
                self._metrics.engine_generated.inc(generated)
                self._metrics.engine_unseen.inc(unseen)
            await asyncio.sleep(self.interval)  # the scrape interval, not a wait for a condition

    # -- aborts --------------------------------------------------------------

    def _stream_opened(self, stream: PipelineStream) -> None:
        meter = stream.relay.meter
        self._open[id(meter)] = meter

    def _stream_finished(self, record: StreamRecord) -> None:
        meter = record.meter
        self._open.pop(id(meter), None)
        self._finished_tokens += meter.tokens_generated
        if meter.end_state in _CANCELLED and self.running:
            self._cancels.append(asyncio.get_running_loop().time())
            if self._aborts is None or self._aborts.done():
                self._aborts = asyncio.get_running_loop().create_task(self._time_aborts())

    async def _time_aborts(self) -> None:
        """Until the engine runs no more requests than the face has open."""
        loop = asyncio.get_running_loop()
        start = await self.read()
        seen_at_start = self.seen()
        while self._cancels:
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
