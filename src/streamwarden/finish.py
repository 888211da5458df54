"""The end of a stream, written once for both faces.

However a stream ends (its upstream or app finished, a limit or timer
fired, the client left, the process drained, a detached stream ran out its
window), each face does its own I/O cleanup (the sidecar gives its upstream
connection back or closes it; the middleware stops its timer and inbox) and
then hands the stream to :meth:`StreamEnd.publish`, which does the rest in
one order, by the same rules for both:

1. a relay still open is ended as ``client_cancelled``: a face's unexpected
   path must never publish a stream without its end state;
2. a resumable stream's journal is sealed (an error event if its end wrote
   none) and its store entry says how it ended, so that a resume from now
   on is answered with the end, never left waiting for more;
3. a stream counted in the detached-streams gauge (:meth:`StreamEnd.count_detached`)
   leaves it;
4. the stream's record is built from the relay and the register closes the
   stream with it: its listeners write the Prometheus metrics and the
   per-stream log line (both hung there by :class:`StreamEnd` itself, so
   both faces have the same ones), and the sidecar's engine watch;
5. the OpenTelemetry spans end with the record.

Steps 3 to 5 run even if the journal's steps raise (a store's sink, say):
a stream left in the register would hold a drain until its deadline, the
gauge would count it forever, and spans that never end are lost to the
trace. What differs between the faces is what they pass: their entry in
the register (the sidecar's ``ActiveStream``, the middleware's responder),
the stream's :class:`StreamIdentity`, its spans, and their clock. No I/O
and no event loop here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from streamwarden.logs import stream_logger
from streamwarden.meter import StreamRecord
from streamwarden.metrics import StreamMetrics
from streamwarden.register import StreamRegister, finished_record
from streamwarden.relay import Relay
from streamwarden.resume_service import ResumeService

if TYPE_CHECKING:
    from streamwarden.telemetry import RequestTrace

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
    """Where one face's streams end: its register, its metrics and its resume service."""

    __slots__ = ("metrics", "register", "resume")

    def __init__(
        self,
        register: StreamRegister[S],
        metrics: StreamMetrics | None = None,
        resume: ResumeService | None = None,
    ) -> None:
        self.register = register
        self.metrics = metrics
        self.resume = resume
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
        if not relay.detached or self.metrics is None:
            return False
        self.metrics.detached.inc()
        return True

    def publish(
        self,
        stream: S,
        relay: Relay,
        identity: StreamIdentity,
        *,
        now: float,
        trace: RequestTrace | None = None,
        counted_detached: bool = False,
    ) -> StreamRecord:
        """Write a finished stream everywhere it goes, once; return its record.

        ``stream`` is the face's own entry in the register, ``now`` the
        face's clock, ``counted_detached`` what :meth:`count_detached` said.
        """
        if not relay.done:
            relay.client_gone(now)
        try:
            journal, resume = relay.journal, self.resume
            if journal is not None and resume is not None:
                relay.seal_journal()
                resume.finished(journal, str(relay.end_state), relay.dialect)
        finally:
            if counted_detached and self.metrics is not None:
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
            self.register.close(stream, record)
            if trace is not None:
                trace.end(identity.status, record)
        return record
