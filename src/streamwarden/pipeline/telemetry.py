"""Telemetry: the request's spans end with the stream's record, not with its head."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamwarden.core.meter import StreamRecord
from streamwarden.pipeline.request import IncomingRequest
from streamwarden.pipeline.stage import PipelineStream, Stage, StreamStart

if TYPE_CHECKING:
    from streamwarden.observation.telemetry import RequestTrace

__all__ = ["Telemetry"]


class Telemetry(Stage):
    __slots__ = ()

    name = "telemetry"
    summary = (
        "`otel_exporter`: a server span per stream, GenAI attributes and metrics from its record"
    )

    def wanted(self, start: StreamStart) -> bool:
        return start.trace is not None

    def opened(self, stream: PipelineStream) -> None:
        trace = stream.start.trace
        assert trace is not None
        trace.streaming = True  # the face must not end it with the head

    def closed(self, stream: PipelineStream, record: StreamRecord) -> None:
        trace = stream.start.trace
        assert trace is not None
        trace.end(stream.start.status, record)

    def traced(self, request: IncomingRequest) -> RequestTrace | None:
        telemetry = self.services.telemetry
        if telemetry is None:
            return None
        headers = {name.lower(): value for name, value in request.headers}
        return telemetry.request(request.method, request.route.route, headers)
