"""What the requests of one middleware instance share: its settings and its register of streams.

The register counts the streams in flight (the ``streamwarden_active_streams``
gauge) and the requests holding a ``max_concurrent_streams`` slot, keeps the
recently finished streams' records (tests and ``streams`` readers use them),
and hands each record to its listeners (metrics, the stream log line)
exactly once, when the stream ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamwarden.config import Settings
from streamwarden.observation.register import Listener, StreamRegister
from streamwarden.pipeline import Pipeline

__all__ = ["FaceContext", "Listener", "Streams"]


class Streams(StreamRegister[object]):
    """The middleware's register of streams (the rules are both faces', in the core)."""


@dataclass(frozen=True, slots=True)
class FaceContext:
    """What every request of one middleware instance shares."""

    settings: Settings
    streams: Streams
    #: What runs on every stream, and where every stream ends.
    pipeline: Pipeline[object]
    #: ``settings.stream_media_types``, lower-cased, for the stream check.
    extra_media_types: frozenset[str] = field(default=frozenset())
