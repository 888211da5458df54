"""The end of a stream, written once for both faces.

However a stream ends (its upstream or app finished, a limit or timer
fired, the client left, the process drained, a detached stream ran out its
window), each face does its own I/O cleanup (the sidecar gives its upstream
connection back or closes it; the middleware stops its timer and inbox) and
then hands the stream (through :meth:`~streamwarden.pipeline.Pipeline.finish`)
to :meth:`StreamEnd.publish`, which does the rest in one order, by the same
rules for both:

1. a relay still open is ended as ``client_cancelled``: a face's unexpected
   path must never publish a stream without its end state;
2. its stages close (``Stage.closing``): a resumable stream's journal is
   sealed (an error event if its end wrote none) and its store entry says
   how it ended, so that a resume from now on is answered with the end,
   never left waiting for more;
3. a stream counted in the detached-streams gauge (:meth:`StreamEnd.count_detached`)
   leaves it;
4. the stream's record is built from the relay and the register closes the
   stream with it: its listeners write the Prometheus metrics and the
   per-stream log line (both hung there by :class:`StreamEnd` itself, so
   both faces have the same ones), and the engine watch if there is one;
5. its stages see the record (``Stage.closed``): the OpenTelemetry spans
   end with it.

Steps 3 to 5 run even if a stage's closing raises (a store's sink, say):
a stream left in the register would hold a drain until its deadline, the
gauge would count it forever, and spans that never end are lost to the
trace. What differs between the faces is what they pass: their entry in
the register (the sidecar's ``ActiveStream``, the middleware's responder),
the stream, its :class:`StreamIdentity`, and their clock. No I/O and no
event loop here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from streamwarden.core.lifecycle import Phase
from streamwarden.core.meter import StreamRecord
from streamwarden.core.relay import Relay
from streamwarden.observation.logs import stream_logger
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.observation.register import StreamRegister, finished_record

if TYPE_CHECKING:
    from streamwarden.pipeline.stage import PipelineStream

__all__ = ["StreamEnd", "StreamIdentity"]

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class StreamIdentity:
    """What a finished stream's record names it by; a face knows it when the stream starts."""

    #: The register's id for the stream (not a resumable stream's journal id).
    stream_id: str
    #: The matched route prefix (the metrics label), never the raw path.
    route: str
    method: str
    #: The request path without its query, for the log line only.
    path: str
    #: The response's status, as the client got it.
    status: int


class StreamEnd(Generic[S]):
    """Where one face's streams end: its register and its metrics."""

    __slots__ = ("metrics", "register")

    def __init__(self, register: StreamRegister[S], metrics: StreamMetrics | None = None) -> None:
        self.register = register
        self.metrics = metrics
        # The listeners every face has, in one place: so that a stream's
        # metrics and log line cannot differ by the face it went through.
        if metrics is not None:
            register.listeners.append(metrics.stream_finished)
        register.listeners.append(stream_logger())

    def count_detached(self, relay: Relay) -> bool:
        """The client left: count the stream as detached if it runs on for a resume.

        True if it was counted; :meth:`publish` is then told so, and takes
        it out of the gauge again.
        """
        if relay.phase is not Phase.DETACHED or self.metrics is None:
            return False
        self.metrics.detached.inc()
        return True

    def publish(
        self, entry: S, stream: PipelineStream, identity: StreamIdentity, *, now: float
    ) -> StreamRecord:
        """Write a finished stream everywhere it goes, once; return its record.

        ``entry`` is the face's own entry in the register, ``now`` the
        face's clock; ``stream.counted_detached`` is what
        :meth:`count_detached` said.
        """
        relay = stream.relay
        relay.stop(now)  # a relay still open ends client_cancelled (one that ended: nothing)
        try:
            for stage in stream.stages:
                stage.closing(stream)
        finally:
            if stream.counted_detached and self.metrics is not None:
                self.metrics.detached.dec()
            record = finished_record(
                identity.stream_id,
                identity.route,
                identity.method,
                identity.path,
                identity.status,
                relay,
            )
            # The register logs a listener that raises and runs the others.
            self.register.close(entry, record)
            for stage in stream.stages:
                stage.closed(stream, record)
        return record
