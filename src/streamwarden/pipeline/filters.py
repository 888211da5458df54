"""Output filters: a match redacted or the stream blocked, on whole events only."""

from __future__ import annotations

from streamwarden.core.transform import EventTransform
from streamwarden.pipeline.holdback import FilterHoldback
from streamwarden.pipeline.stage import PipelineStream, Stage, StreamStart

__all__ = ["OutputFilters"]


class OutputFilters(Stage):
    __slots__ = ()

    name = "filters"
    summary = "`output_filters`: redact or block a match, events held back only while it may start"

    def wanted(self, start: StreamStart) -> bool:
        # A WebSocket's messages too: a rewritten message is its new data
        # (core.sse.with_data), and what the hold-back lets go is sent as
        # messages (core.messages.MessageSession).
        return start.route.output_filters is not None

    def transform(self, stream: PipelineStream) -> EventTransform:
        route = stream.start.route
        assert route.output_filters is not None
        return FilterHoldback(stream.relay, route.output_filters, route.limits.max_event_bytes)
