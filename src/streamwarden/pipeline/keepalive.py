"""Keep-alive: a comment frame while the model is quiet, so no hop cuts an idle stream."""

from __future__ import annotations

from streamwarden.pipeline.stage import RelayOptions, Stage, StreamStart

__all__ = ["KeepAlive"]


class KeepAlive(Stage):
    __slots__ = ()

    name = "keep-alive"
    summary = "`: keep-alive` between events after `keepalive_interval` with nothing written"

    def wanted(self, start: StreamStart) -> bool:
        # (The relay writes one only where the framing has comments: SSE.)
        return start.route.limits.keepalive_interval > 0

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        options.keepalive_interval = start.route.limits.keepalive_interval
