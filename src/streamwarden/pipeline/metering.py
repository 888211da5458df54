"""Metering: the inter-token gaps as they happen (the rest of the meter is the relay's own)."""

from __future__ import annotations

from streamwarden.pipeline.stage import FaceServices, RelayOptions, Stage, StreamStart

__all__ = ["Metering"]


class Metering(Stage):
    __slots__ = ()

    name = "metering"
    summary = (
        "inter-token gaps into their histogram as they happen (counts, TTFT and end state "
        "are every stream's, from its record)"
    )

    @classmethod
    def build(cls, services: FaceServices) -> Metering | None:
        return cls(services) if services.gap_observer is not None else None

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        options.gap_observer = self.services.gap_observer
