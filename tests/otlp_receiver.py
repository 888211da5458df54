"""A real OTLP/HTTP receiver on loopback, and what it reads from the spans it got.

It decodes the exporters' real requests with ``opentelemetry-proto``: import
it only where the otel extra is installed (after
``pytest.importorskip("opentelemetry.sdk")``). The conftest's ``receiver``
fixture serves one for the faces' exporters; tests/observation/test_telemetry.py
has its own, with the metrics exported too.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

#: The trace id of the ``traceparent`` the telemetry tests send.
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Receiver:
    """An OTLP/HTTP receiver: what the exporters really sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.metrics: dict[str, Any] = {}
        self.app = web.Application()
        self.app.router.add_post("/v1/traces", self.traces)
        self.app.router.add_post("/v1/metrics", self.metrics_in)

    async def traces(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return web.Response(content_type="application/x-protobuf", body=b"")

    async def metrics_in(self, request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    self.metrics[metric.name] = metric
        return web.Response(content_type="application/x-protobuf", body=b"")


def attributes(span: Any) -> dict[str, Any]:
    """A span's attributes, as a dict of plain values."""
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind)
    return out


def servers(receiver: Receiver) -> list[Any]:
    """The server spans received (one a stream a face served)."""
    return [s for s in receiver.spans if s.kind == 2]  # SPAN_KIND_SERVER
