"""OpenTelemetry for both faces: a span per request, the GenAI conventions, what only a relay knows.

Off unless ``otel_exporter`` is ``otlp-http`` or ``otlp-grpc`` (the
``otel`` extra: the OpenTelemetry SDK and its OTLP exporters). The
standard ``OTEL_*`` variables apply (endpoint, headers, batch and export
intervals); ``OTEL_SERVICE_NAME`` defaults to ``streamwarden``.

Per proxied request: a server span continued from the client's
``traceparent``/``tracestate``, and a client span for the upstream call
whose context goes upstream in ``traceparent``, so the inference server's
spans join the trace. Both end with the stream, from its one record
(:class:`~streamwarden.core.meter.StreamRecord`); the attributes are
:data:`ATTRIBUTES`' (the docs' table is printed from it). Span events
mark the first token and the end, never each token. The GenAI metrics are
recorded from the same record, next to the Prometheus ones.

Nothing here waits on the collector: spans and metrics are exported from
the SDK's own worker threads, in bounded queues; a failed export is
counted (``streamwarden_otel_export_errors_total``) and logged at most
once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.context import Context, attach, detach
from opentelemetry.metrics import Histogram
from opentelemetry.propagate import inject
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from streamwarden.config import Settings
from streamwarden.core.meter import EndState, StreamRecord
from streamwarden.observation.logs import RateLimitedWarnings

__all__ = [
    "ATTRIBUTES",
    "INSTRUMENTS",
    "RequestTrace",
    "Telemetry",
    "attribute_table",
    "instrument_table",
]

log = logging.getLogger("streamwarden.telemetry")

#: Every attribute a request's spans may carry, and what it means.
ATTRIBUTES: dict[str, str] = {
    "gen_ai.operation.name": "`chat` (chat-style dialects) or `text_completion`",
    "gen_ai.provider.name": "the provider the dialect speaks for (`openai`, `anthropic`, ...)",
    "gen_ai.request.stream": "the response was a stream",
    "gen_ai.request.model": "the model the request named (only with `otel_record_models`)",
    "gen_ai.usage.output_tokens": "tokens generated (the provider's count when it sent one)",
    "gen_ai.usage.input_tokens": "the prompt's tokens (only when the provider counted them)",
    "gen_ai.response.time_to_first_chunk": "seconds from the request to the first content event",
    "http.request.method": "the request method",
    "http.route": "the matched route prefix (`/` when none)",
    "http.response.status_code": "the response status",
    "streamwarden.end_state": "how the stream ended",
    "streamwarden.error_code": "the code of the error event written, if one was",
    "streamwarden.dialect": "the stream's wire format",
    "streamwarden.tokens.delivered": "tokens written to the client",
    "streamwarden.tokens.zombie": "tokens generated after the client had gone",
    "streamwarden.tokens.source": "`provider`, `provider_partial` or `estimated`",
    "streamwarden.keepalives": "keep-alive comments written",
    "streamwarden.cancel_propagation_s": "client gone noticed to upstream closed",
    "streamwarden.detached": "the client left and the stream ran on for a resume",
    "streamwarden.tool_calls.ids": "the stream's tool calls' ids, the first 16 (only with calls)",
    "streamwarden.tool_calls.names": "their names, in the same order",
    "streamwarden.tool_calls.end_states": "how each ended: `complete`, `truncated`, `invalid`"
    " or `too_large`",
}

_PROVIDERS = {
    "openai-chat": "openai",
    "openai-responses": "openai",
    "anthropic": "anthropic",
    "gemini": "gcp.gemini",
    "cohere": "cohere",
    "ndjson": "ollama",
    "vercel-ai": "vercel",
}
# The conventions' bucket boundaries (GenAI metrics semantic conventions).
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
]
_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
_DURATION_BUCKETS = [
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
]
_TOKEN_BUCKETS = [
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
]
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
_FAILED = frozenset(
    {
        EndState.UPSTREAM_TRUNCATED,
        EndState.UPSTREAM_ERROR,
        EndState.UPSTREAM_TIMEOUT,
        EndState.LIMIT_EXCEEDED,
        EndState.SHUTDOWN,
        EndState.BLOCKED,  # an output filter stopped the answer: the span says content_blocked
    }
)


#: The GenAI metrics, each a histogram: unit, what it measures, the
#: conventions' bucket boundaries.
INSTRUMENTS: dict[str, tuple[str, str, list[float]]] = {
    "gen_ai.server.time_to_first_token": ("s", "request to the first content event", _TTFT_BUCKETS),
    "gen_ai.server.time_per_output_token": (
        "s",
        "mean gap between content events after the first",
        _TPOT_BUCKETS,
    ),
    "gen_ai.client.operation.duration": (
        "s",
        "request to the end of the stream",
        _DURATION_BUCKETS,
    ),
    "gen_ai.client.token.usage": (
        "{token}",
        "tokens generated (`gen_ai.token.type=output`) and the prompt's tokens where the"
        " provider counted them (`input`)",
        [float(b) for b in _TOKEN_BUCKETS],
    ),
}


def instrument_table() -> str:
    """The docs' table of the GenAI metrics (docs/opentelemetry.md)."""
    rows = ["| metric | unit | what it measures |", "|---|---|---|"]
    rows += [f"| `{name}` | `{unit}` | {what} |" for name, (unit, what, _) in INSTRUMENTS.items()]
    return "\n".join(rows) + "\n"


def attribute_table() -> str:
    """The docs' table of span attributes (docs/opentelemetry.md)."""
    rows = ["| attribute | what it is |", "|---|---|"]
    rows += [f"| `{name}` | {what} |" for name, what in ATTRIBUTES.items()]
    return "\n".join(rows) + "\n"


class _Counted:
    """Counts and logs (rate-limited) the exports that failed; never raises."""

    def __init__(self, on_error: Any) -> None:
        self._on_error = on_error
        self._warnings = RateLimitedWarnings(60.0, log)

    def failed(self, what: str) -> None:
        self._on_error()
        self._warnings.warn("otel", "OpenTelemetry export of %s failed (collector down?)", what)


class _SpanExporter(SpanExporter):
    def __init__(self, inner: SpanExporter, counted: _Counted) -> None:
        self._inner = inner
        self._counted = counted

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._counted.failed("spans")
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _MetricExporter(MetricExporter):
    def __init__(self, inner: MetricExporter, counted: _Counted) -> None:
        super().__init__(
            preferred_temporality=inner._preferred_temporality,
            preferred_aggregation=inner._preferred_aggregation,
        )
        self._inner = inner
        self._counted = counted

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:
            result = MetricExportResult.FAILURE
        if result is not MetricExportResult.SUCCESS:
            self._counted.failed("metrics")
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _exporters(kind: str) -> tuple[SpanExporter, MetricExporter]:
    if kind == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (  # type: ignore[assignment]
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter(), OTLPMetricExporter()


class RequestTrace:
    """One request's two spans: the server span, and the upstream call under it."""

    __slots__ = ("_ended", "_telemetry", "client", "server", "started_ns", "streaming")

    def __init__(self, telemetry: Telemetry, server: Span, client: Span) -> None:
        self._telemetry = telemetry
        self.server = server
        self.client = client
        self.started_ns = time.time_ns()
        self._ended = False
        #: A stream took the spans over: they end with its record, not the handler.
        self.streaming = False

    def named_model(self, body_start: bytes) -> None:
        """``gen_ai.request.model`` from the request body (only with ``otel_record_models``)."""
        if not self._telemetry.record_models:
            return
        found = _MODEL.search(body_start)
        if found is not None:
            model = found.group(1).decode("utf-8", "replace")
            for span in (self.server, self.client):
                span.set_attribute("gen_ai.request.model", model)

    def activate(self) -> object:
        """Make the upstream call's span current (an app's own instrumented clients
        then continue the trace); :meth:`deactivate` with what this returns."""
        return attach(set_span_in_context(self.client))

    def deactivate(self, token: object) -> None:
        detach(token)  # type: ignore[arg-type]

    def upstream_headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) of the upstream call, to send upstream."""
        carrier: dict[str, str] = {}
        inject(carrier, context=set_span_in_context(self.client))
        return carrier

    def end(self, status: int, record: StreamRecord | None = None) -> None:
        """End both spans: with the stream's record, or for a request that was not one."""
        if self._ended:
            return
        self._ended = True
        self._telemetry.finish(self, status, record)


class Telemetry:
    """The tracer and the GenAI instruments of one face."""

    def __init__(
        self, settings: Settings, on_export_error: Any = None, *, own_process: bool = False
    ) -> None:
        if own_process:
            # The exporters log every retry; ours says it once a minute. Only
            # where the process is ours (the sidecar): an app's exporters are its own.
            logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
            logging.getLogger("opentelemetry.sdk").setLevel(logging.CRITICAL)
        name = os.environ.get("OTEL_SERVICE_NAME") or "streamwarden"
        resource = Resource.create({SERVICE_NAME: name})
        counted = _Counted(on_export_error or (lambda: None))
        spans, metrics = _exporters(settings.otel_exporter)
        self._tracer_provider = TracerProvider(resource=resource)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(_SpanExporter(spans, counted)))
        self.tracer = self._tracer_provider.get_tracer("streamwarden")
        reader = PeriodicExportingMetricReader(_MetricExporter(metrics, counted))
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        meter = self._meter_provider.get_meter("streamwarden")
        made = {
            name: meter.create_histogram(
                name, unit=unit, description=what, explicit_bucket_boundaries_advisory=buckets
            )
            for name, (unit, what, buckets) in INSTRUMENTS.items()
        }
        self._ttft = made["gen_ai.server.time_to_first_token"]
        self._tpot = made["gen_ai.server.time_per_output_token"]
        self._tokens: Histogram = made["gen_ai.client.token.usage"]
        self._duration = made["gen_ai.client.operation.duration"]
        self._propagator = TraceContextTextMapPropagator()
        self.record_models = settings.otel_record_models

    def request(self, method: str, route: str, headers: Mapping[str, str]) -> RequestTrace:
        """Start a request's spans, under the client's ``traceparent`` if it sent one."""
        # The propagator looks names up as written: header names are any case.
        carrier = {name.lower(): value for name, value in headers.items()}
        parent: Context = self._propagator.extract(carrier=carrier)
        server = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        client = self.tracer.start_span(
            "upstream", context=set_span_in_context(server), kind=SpanKind.CLIENT
        )
        return RequestTrace(self, server, client)

    def finish(self, trace: RequestTrace, status: int, record: StreamRecord | None) -> None:
        server, client = trace.server, trace.client
        attributes: dict[str, Any] = {"http.response.status_code": status}
        now_ns = time.time_ns()
        if record is not None:
            attributes.update(self._stream_attributes(record))
            meter = record.meter
            operation = attributes["gen_ai.operation.name"]
            client.update_name(f"{operation} {record.dialect}")
            if meter.ttft is not None:
                server.add_event(
                    "gen_ai.first_token", timestamp=trace.started_ns + int(meter.ttft * 1e9)
                )
            server.add_event("streamwarden.end", {"streamwarden.end_state": str(meter.end_state)})
            self._record_metrics(record, attributes)
        for span in (client, server):
            span.set_attributes(attributes)
            failed = status >= 500 or (record is not None and record.meter.end_state in _FAILED)
            if failed:
                span.set_status(
                    Status(
                        StatusCode.ERROR, str(attributes.get("streamwarden.error_code") or status)
                    )
                )
            span.end(end_time=now_ns)

    def _stream_attributes(self, record: StreamRecord) -> dict[str, Any]:
        meter = record.meter
        dialect = record.dialect
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "text_completion" if dialect == "generic" else "chat",
            "gen_ai.request.stream": True,
            "gen_ai.usage.output_tokens": meter.tokens_generated,
            "streamwarden.end_state": str(meter.end_state),
            "streamwarden.dialect": dialect,
            "streamwarden.tokens.delivered": meter.tokens_delivered,
            "streamwarden.tokens.zombie": meter.tokens_zombie,
            "streamwarden.tokens.source": meter.tokens_source,
            "streamwarden.keepalives": meter.keepalives,
        }
        provider = _PROVIDERS.get(dialect)
        if provider is not None:
            attributes["gen_ai.provider.name"] = provider
        if meter.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = meter.input_tokens
        if meter.ttft is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = meter.ttft
        if meter.error_code is not None:
            attributes["streamwarden.error_code"] = meter.error_code
        if meter.cancel_propagation is not None:
            attributes["streamwarden.cancel_propagation_s"] = meter.cancel_propagation
        if meter.end_state is EndState.DETACHED_EXPIRED:
            attributes["streamwarden.detached"] = True
        if meter.tool_calls is not None:
            calls = meter.tool_calls.record()
            attributes["streamwarden.tool_calls.ids"] = [c["id"] for c in calls]
            attributes["streamwarden.tool_calls.names"] = [c["name"] for c in calls]
            attributes["streamwarden.tool_calls.end_states"] = [c["end_state"] for c in calls]
        return attributes

    def _record_metrics(self, record: StreamRecord, attributes: Mapping[str, Any]) -> None:
        meter = record.meter
        labels = {
            key: attributes[key]
            for key in ("gen_ai.operation.name", "gen_ai.provider.name")
            if key in attributes
        }
        if meter.ttft is not None:
            self._ttft.record(meter.ttft, labels)
        if meter.gap_count:
            self._tpot.record(meter.gap_sum / meter.gap_count, labels)
        if meter.duration is not None:
            self._duration.record(meter.duration, labels)
        self._tokens.record(meter.tokens_generated, {**labels, "gen_ai.token.type": "output"})
        if meter.input_tokens is not None:
            self._tokens.record(meter.input_tokens, {**labels, "gen_ai.token.type": "input"})

    def shutdown(self) -> None:
        self._tracer_provider.shutdown()
        self._meter_provider.shutdown()

    async def shutdown_within(self, seconds: float) -> None:
        """Flush and stop, waiting at most ``seconds``: a daemon thread, so that a
        collector that is down cannot hold the process's exit (asyncio's own
        executor would be waited for at the end of ``asyncio.run``)."""
        done = threading.Event()

        def flush() -> None:
            try:
                self.shutdown()
            finally:
                done.set()

        threading.Thread(target=flush, name="streamwarden-otel-shutdown", daemon=True).start()
        deadline = time.monotonic() + seconds
        while not done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling the flush thread, bounded by ``seconds``
