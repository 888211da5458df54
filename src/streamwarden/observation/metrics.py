"""Prometheus collectors for both faces, fed from finished and ongoing streams.

Each face owns one :class:`StreamMetrics` (its own registry, so several
proxies in one process, as in tests, never share counters). Finished
streams arrive as :class:`~streamwarden.core.meter.StreamRecord` objects;
inter-token gaps are observed live through the meter's gap observer.

Labels stay low-cardinality: dialect, end state, error code and the
configured route prefix. Never a raw path, a model name or a user.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from streamwarden.core.meter import GapCounts, StreamRecord

__all__ = ["CONTENT_TYPE_LATEST", "StreamMetrics", "metric_table"]

# Every counter and histogram would also export a *_created series (its
# creation time): twice the series for nothing a dashboard uses.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Time to first token: from 10 ms (a warm small model) to 60 s (huge prompts).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# Gaps between tokens: 1 ms (batched) to 10 s (a long tool call).
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# An event held by the output filters waits about one gap between tokens.
HOLD_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Client gone to upstream closed: the whole point is that this is sub-millisecond.
# A cancel to the engine's stop: a healthy engine within tens of ms.
ABORT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CANCEL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def _task_count() -> float:
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # no running loop (a scrape from another thread)
        return 0.0


class GapHistogram(Collector):
    """A histogram with no labels and no lock, for the one observation made per event.

    ``prometheus_client``'s ``Histogram.observe`` takes a lock and walks
    its buckets on every call: about a microsecond, on the path of every
    token. The counting is :class:`~streamwarden.core.meter.GapCounts`
    (:attr:`counts`), compiled with the meter that calls it; this collector
    reads it at a scrape.
    """

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self._name = name
        self._documentation = documentation
        #: What the meters count into (``gap_observer`` of the faces' pipelines).
        self.counts = GapCounts(buckets)
        self._labelnames: tuple[str, ...] = ()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts.observe(value)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation)

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*counts.bounds, float("inf")), list(counts.counts), strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily(
            self._name, self._documentation, buckets=buckets, sum_value=counts.total
        )


class StreamMetrics:
    """The streamwarden_* metrics of one face."""

    def __init__(self, active: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.streams = Counter(
            "streamwarden_streams",
            "Streams finished, by dialect, end state and route prefix.",
            ["dialect", "end_state", "route"],
            registry=r,
        )
        self.active = Gauge("streamwarden_active_streams", "Streams in flight.", registry=r)
        if active is not None:
            self.active.set_function(lambda: float(active()))
        # A leak shows first as tasks that never end; scraped from inside the
        # event loop, so all_tasks() sees the serving loop.
        self.tasks = Gauge(
            "streamwarden_asyncio_tasks", "Tasks alive in the serving event loop.", registry=r
        )
        self.tasks.set_function(_task_count)
        self.ttft = Histogram(
            "streamwarden_ttft_seconds",
            "Request to first content event written to the client.",
            ["dialect"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token = GapHistogram(
            "streamwarden_inter_token_seconds",
            "Gaps between content events written to the client.",
            GAP_BUCKETS,
            r,
        )
        self.duration = Histogram(
            "streamwarden_stream_duration_seconds",
            "Request to end of stream.",
            ["dialect"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        # source: provider (final usage), provider_partial (a lower bound), estimated.
        self.generated = Counter(
            "streamwarden_tokens_generated",
            "Tokens generated upstream, by where the count came from (source).",
            ["dialect", "source"],
            registry=r,
        )
        self.delivered = Counter(
            "streamwarden_tokens_delivered",
            "Tokens written to clients, by where the count came from (source).",
            ["dialect", "source"],
            registry=r,
        )
        self.zombie = Counter(
            "streamwarden_zombie_tokens",
            "Tokens the upstream sent after the client had gone, by source.",
            ["dialect", "source"],
            registry=r,
        )
        self.cancel = Histogram(
            "streamwarden_cancel_propagation_seconds",
            "Client disconnect noticed to upstream closed.",
            buckets=CANCEL_BUCKETS,
            registry=r,
        )
        self.keepalives = Counter(
            "streamwarden_keepalives", "Keep-alive comments written.", registry=r
        )
        self.synthesized = Counter(
            "streamwarden_synthesized_errors",
            "Error events written in place of a silent failure, by code.",
            ["code"],
            registry=r,
        )
        self.tool_calls = Counter(
            "streamwarden_tool_calls",
            "Tool calls followed to their end, by dialect and end state (complete, truncated,"
            " invalid, too_large).",
            ["dialect", "end_state"],
            registry=r,
        )

        self.refused = Counter(
            "streamwarden_refused_connections",
            "Client connections the proxy answered or cut itself (slow or malformed heads,"
            " too_many_connections past max_client_connections).",
            ["reason"],
            registry=r,
        )
        self.client_connections = Gauge(
            "streamwarden_client_connections",
            "Places held under max_client_connections: client connections open on the proxy"
            " port, idle ones included, and streams read on after their client left (drain,"
            " detach), each with its upstream connection (sidecar).",
            registry=r,
        )
        self.client_connections_limit = Gauge(
            "streamwarden_client_connections_limit",
            "max_client_connections as it applies: set, or derived from the open-files limit"
            " (sidecar).",
            registry=r,
        )
        self.websockets = Counter(
            "streamwarden_websocket_sessions",
            "WebSocket sessions relayed, by how they ended.",
            ["end_state"],
            registry=r,
        )
        self.active_websockets = Gauge(
            "streamwarden_active_websockets", "WebSocket sessions in flight.", registry=r
        )

        self.resumes = Counter(
            "streamwarden_resumes",
            "Resume requests (Last-Event-ID), by result: ok, expired, gap, denied, unavailable.",
            ["result"],
            registry=r,
        )
        self.replayed = Counter(
            "streamwarden_resume_events_replayed",
            "Events written to resumed clients from the resume store.",
            registry=r,
        )
        self.detached = Gauge(
            "streamwarden_detached_streams",
            "Streams running on after their client left, kept for a resume.",
            registry=r,
        )
        self.store_bytes = Gauge(
            "streamwarden_resume_store_bytes",
            "Bytes of events held by this process's resume store (memory store).",
            registry=r,
        )
        self.store_queue = Gauge(
            "streamwarden_resume_store_queue",
            "Writes waiting for the Redis resume store.",
            registry=r,
        )
        self.store_errors = Counter(
            "streamwarden_resume_store_errors",
            "Failed or dropped writes and reads of the Redis resume store.",
            registry=r,
        )

        self.engine_generated = Counter(
            "streamwarden_engine_generated_tokens",
            "Tokens the inference engine says it generated (engine_metrics_url).",
            registry=r,
        )
        self.engine_unseen = Counter(
            "streamwarden_engine_unseen_tokens",
            "Tokens the engine generated that no stream through this sidecar accounts for.",
            registry=r,
        )
        self.engine_abort = Histogram(
            "streamwarden_engine_abort_seconds",
            "A stream cancelled to the engine running no more requests than are open.",
            buckets=ABORT_BUCKETS,
            registry=r,
        )
        self.engine_abort_timeouts = Counter(
            "streamwarden_engine_abort_timeouts",
            "Cancelled streams the engine had not stopped within 5 s of the cancel.",
            registry=r,
        )
        self.engine_after_cancel = Counter(
            "streamwarden_engine_tokens_after_cancel",
            "Tokens the engine generated between a cancel and its stop, unseen by streams.",
            registry=r,
        )
        self.engine_watches = Gauge(
            "streamwarden_engine_watches",
            "Watches of this engine on the host, this one included; over 1, none reconciles.",
            registry=r,
        )
        self.engine_scrape_errors = Counter(
            "streamwarden_engine_scrape_errors",
            "Scrapes of the engine's metrics that failed or found no known counter.",
            registry=r,
        )

        self.filter_matches = Counter(
            "streamwarden_filter_matches",
            "Output filter matches, by filter name and action (redact, block).",
            ["filter", "action"],
            registry=r,
        )
        self.filter_held_bytes = Counter(
            "streamwarden_filter_held_bytes",
            "Bytes of events that waited for a possible output filter match to resolve.",
            registry=r,
        )
        self.filter_hold = GapHistogram(
            "streamwarden_filter_holdback_seconds",
            "How long an event waited for a possible output filter match to resolve.",
            HOLD_BUCKETS,
            r,
        )

        self.otel_errors = Counter(
            "streamwarden_otel_export_errors",
            "OpenTelemetry exports (spans, metrics) that failed: the collector is down or slow.",
            registry=r,
        )

    def websocket_session(self, end: str | None) -> None:
        """A WebSocket session started (``None``) or ended, and how."""
        if end is None:
            self.active_websockets.inc()
            return
        self.websockets.labels(end).inc()
        if end != "refused":
            self.active_websockets.dec()

    def watch_client_connections(self, open_now: Callable[[], int], limit: int) -> None:
        """The proxy port's open client connections, read at each scrape, and their limit."""
        self.client_connections.set_function(lambda: float(open_now()))
        self.client_connections_limit.set(limit)

    def connection_refused(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def stream_finished(self, record: StreamRecord) -> None:
        meter = record.meter
        dialect = record.dialect
        self.streams.labels(dialect, str(meter.end_state), record.route).inc()
        if meter.ttft is not None:
            self.ttft.labels(dialect).observe(meter.ttft)
        if meter.duration is not None:
            self.duration.labels(dialect).observe(meter.duration)
        source = meter.tokens_source
        self.generated.labels(dialect, source).inc(meter.tokens_generated)
        self.delivered.labels(dialect, source).inc(meter.tokens_delivered)
        self.zombie.labels(dialect, source).inc(meter.tokens_zombie)
        if meter.cancel_propagation is not None:
            self.cancel.observe(meter.cancel_propagation)
        if meter.keepalives:
            self.keepalives.inc(meter.keepalives)
        if meter.error_code is not None:
            self.synthesized.labels(meter.error_code).inc()
        calls = meter.tool_calls
        if calls is not None:
            for state, count in calls.counts().items():
                self.tool_calls.labels(dialect, state).inc(count)
        filters = meter.filters
        if filters is not None:
            for (name, action), count in filters.matches.items():
                self.filter_matches.labels(name, action).inc(count)
            if filters.held_bytes:
                self.filter_held_bytes.inc(filters.held_bytes)
            for seconds in filters.hold_times:
                self.filter_hold.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def metric_table() -> str:
    """The docs' metric table (docs/reference/metrics.md), made from the collectors themselves.

    ``python -m streamwarden.observation.metrics`` prints it; a test holds the page to
    it, so the table is never kept by hand.
    """
    metrics = StreamMetrics()
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for collector in metrics.__dict__.values():
        if not isinstance(collector, Counter | Gauge | Histogram | GapHistogram):
            continue
        described = next(iter(collector.describe()))
        name = described.name + ("_total" if described.type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in collector._labelnames) or "–"
        rows.append(f"| `{name}` | {described.type} | {labels} | {described.documentation} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(metric_table(), end="")
