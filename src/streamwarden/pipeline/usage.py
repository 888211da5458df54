"""Usage injection's stream side: take back exactly what the added option added.

The request side is the sidecar's (:mod:`streamwarden.sidecar.injection`):
it decides, from the path's learned habit, whether the request went with
``stream_options.include_usage`` added and what to take back, or went
unchanged to learn the habit (:mod:`streamwarden.core.usage`). The stream
carries that decision in :attr:`StreamStart.usage`.
"""

from __future__ import annotations

from streamwarden.pipeline.stage import RelayOptions, Stage, StreamStart

__all__ = ["UsageTakeBack"]


class UsageTakeBack(Stage):
    __slots__ = ()

    name = "usage"
    summary = (
        "`usage_injection`: the provider's exact count, with only what the added option "
        "added taken back out"
    )
    middleware_gap = (
        "the app builds its provider's request: the middleware only sees the app's response"
    )

    def wanted(self, start: StreamStart) -> bool:
        return start.usage is not None

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        options.usage = start.usage
