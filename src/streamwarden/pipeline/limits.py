"""Limits: a silent upstream and an endless stream end with the dialect's error event."""

from __future__ import annotations

from streamwarden.pipeline.stage import RelayOptions, Stage, StreamStart

__all__ = ["StreamLimits"]


class StreamLimits(Stage):
    __slots__ = ()

    name = "limits"
    summary = "`upstream_idle_timeout` and `max_stream_duration` end the stream with an error event"

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        limits = start.route.limits
        options.upstream_idle_timeout = limits.upstream_idle_timeout
        options.max_stream_duration = limits.max_stream_duration
