"""Output filters: a match redacted or the stream blocked, on whole events only."""

from __future__ import annotations

from streamwarden.pipeline.stage import RelayOptions, Stage, StreamStart

__all__ = ["OutputFilters"]


class OutputFilters(Stage):
    __slots__ = ()

    name = "filters"
    summary = "`output_filters`: redact or block a match, events held back only while it may start"

    def wanted(self, start: StreamStart) -> bool:
        return start.route.output_filters is not None

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        options.filters = start.route.output_filters
