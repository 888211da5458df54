"""What a stage is: one capability on the path of every stream, with hooks both faces call.

A stage knows nothing of aiohttp or ASGI. A face tells the pipeline what
it knows when a response turns out to be a stream (:class:`StreamStart`);
each stage that is :meth:`~Stage.wanted` for it then, in the order of the
plan (:data:`streamwarden.pipeline.STAGES`):

1. :meth:`~Stage.configure` sets what the relay is built with
   (:class:`RelayOptions`: limits, the gap observer);
2. :meth:`~Stage.transform` may give the stream an
   :class:`~streamwarden.core.transform.EventTransform`, which sees every
   whole event after the dialect read it and before it is written, and the
   stream's ending (output filters, usage take-back, the journal's ids);
   the relay runs them in the plan's order, and none on a stream that
   has none;
3. :meth:`~Stage.opened` acts on the stream once its relay exists:
   headers to add to the response's head (and what the head waits for), a
   ``stop`` a resume service may call, a ``holds`` a detached stream asks;
4. :meth:`~Stage.closing` runs at its end, before its record is written
   (a journal sealed), and :meth:`~Stage.closed` after, with the record
   (a span ended).

Every hook does nothing unless a stage overrides it, so a stage says only
what it does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.meter import GapObserver, StreamRecord
from streamwarden.core.plan import MESSAGES_PLAN, StreamPlan
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.toolcalls import DEPTH
from streamwarden.core.transform import EventTransform
from streamwarden.core.usage import UsageRole

if TYPE_CHECKING:
    from streamwarden.features.resume.service import ResumeService
    from streamwarden.observation.metrics import StreamMetrics
    from streamwarden.observation.telemetry import RequestTrace, Telemetry
    from streamwarden.pipeline.request import Answer, Forward, IncomingRequest, Serve

__all__ = [
    "Face",
    "FaceServices",
    "PipelineStream",
    "RelayOptions",
    "Stage",
    "StreamStart",
]

T = TypeVar("T")

#: The two faces over the one core.
Face = Literal["sidecar", "middleware"]


@dataclass(frozen=True, slots=True)
class FaceServices:
    """What one face (a sidecar process, a middleware instance) shares with its stages."""

    face: Face
    settings: Settings
    metrics: StreamMetrics | None = None
    resume: ResumeService | None = None
    #: The inter-token gap histogram's observer (metrics on), or None.
    gap_observer: GapObserver | None = None
    #: OpenTelemetry spans and GenAI metrics (otel_exporter), or None.
    telemetry: Telemetry | None = None


@dataclass(frozen=True, slots=True)
class StreamStart:
    """What a face knows when a response turned out to be a stream."""

    face: Face
    route: ResolvedRoute
    plan: StreamPlan
    method: str
    #: The request path without its query.
    path: str
    #: The response's status, as the client gets it.
    status: int
    #: The request's headers (a resumable stream's owner is made of them).
    request_headers: tuple[tuple[str, str], ...]
    #: The response's headers as the upstream or app sent them (case-insensitive
    #: or lower-case names): the dialect is detected from them.
    response_headers: Mapping[str, str]
    #: When the request arrived, and now, on the face's clock.
    started_at: float
    now: float
    #: The request side's part in usage injection (sidecar), or None.
    usage: UsageRole = None
    #: The request's OpenTelemetry spans, when telemetry is on.
    trace: RequestTrace | None = None
    #: The request's query string (a resumable stream's owner is made of it too:
    #: Gemini's ``?key=``).
    query_string: str = ""

    @classmethod
    def of_message(
        cls,
        face: Face,
        route: ResolvedRoute,
        path: str,
        started_at: float,
        now: float,
        trace: RequestTrace | None = None,
    ) -> StreamStart:
        """One stream a WebSocket session carries (a ``response.create``'s), either face.

        Its framing is the session's messages; nothing of the handshake is
        kept, as no stage of a message stream uses it; ``trace``: its own
        span (telemetry on).
        """
        return cls(
            face, route, MESSAGES_PLAN, "GET", path, 101, (), {}, started_at, now, trace=trace
        )


@dataclass(slots=True)
class RelayOptions:
    """What the relay of one stream is built with; the stages fill it in."""

    #: Not a stage's: every buffer has its bound, whatever is planned.
    max_event_bytes: int
    #: Likewise: the tool calls' arguments held, bounded on every stream.
    max_tool_arguments_bytes: int = 1024 * 1024
    max_tool_arguments_depth: int = DEPTH
    #: The rest is "off" by default: a stage that is not planned adds nothing.
    keepalive_interval: float = 0.0
    upstream_idle_timeout: float = 0.0
    max_stream_duration: float = 0.0
    gap_observer: GapObserver | None = None

    def limits(self) -> Limits:
        return Limits(
            self.keepalive_interval,
            self.upstream_idle_timeout,
            self.max_stream_duration,
            self.max_event_bytes,
            self.max_tool_arguments_bytes,
            self.max_tool_arguments_depth,
        )


@dataclass(slots=True, eq=False)
class PipelineStream:
    """One stream through the pipeline: its relay, what its stages add, and its end."""

    start: StreamStart
    relay: Relay
    #: The register's id for the stream.
    stream_id: str
    #: The stages planned for it, in order.
    stages: tuple[Stage, ...]
    #: Headers the stages add to the response's head.
    headers: list[tuple[str, str]] = field(default_factory=list)
    #: The face's way to stop the stream at once (an owner's ``DELETE``): :meth:`stop_by`.
    on_stop: Callable[[], None] | None = None
    #: A stop came before the face could act on it: it acts as soon as it can.
    stop_pending: bool = False
    #: For a detached stream: how much longer a resume holds it (``None``: nobody).
    holds: Callable[[], Awaitable[float | None]] | None = None
    #: What the face awaits before the head goes out (``None``: nothing): a
    #: resumable stream's owner reaching a shared store, so that a resume
    #: sent anywhere the instant the client has the id finds the stream.
    before_head: Awaitable[object] | None = None
    #: Counted in the detached-streams gauge (client gone, kept for a resume).
    counted_detached: bool = False

    def transform_of(self, kind: type[T]) -> T | None:
        """The stream's transform of that kind, if a stage gave it one."""
        chain = self.relay.chain
        for transform in chain.transforms if chain is not None else ():
            if isinstance(transform, kind):
                return transform
        return None

    def stop(self) -> None:
        """Stop the stream now, through its face (or as soon as the face can)."""
        if self.on_stop is not None:
            self.on_stop()
        else:
            self.stop_pending = True

    def stop_by(self, on_stop: Callable[[], None]) -> None:
        """The face can stop the stream now, with ``on_stop``; a stop that came early acts."""
        self.on_stop = on_stop
        if self.stop_pending:
            on_stop()

    def head(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The response's headers with the stages' own: theirs replace any of the same name.

        (An app or upstream behind us may send one, another sidecar's stream
        id, say: a client must see one value, ours.)
        """
        if not self.headers:
            return headers
        ours = {name.lower() for name, _ in self.headers}
        return [(n, v) for n, v in headers if n.lower() not in ours] + self.headers


class Stage:
    """One capability on the path of every stream; one subclass a module.

    Subclasses name themselves (``name``), say in one line what they do
    (``summary``, for the README's parity table), and where the middleware
    cannot run them, why (``middleware_gap``). A stage is built once per
    face with :meth:`build`, which may say it has nothing to do there.
    """

    __slots__ = ("services",)

    name: ClassVar[str]
    summary: ClassVar[str]
    #: Why the middleware cannot run this stage ("" when it can).
    middleware_gap: ClassVar[str] = ""

    def __init__(self, services: FaceServices) -> None:
        self.services = services

    @classmethod
    def build(cls, services: FaceServices) -> Stage | None:
        """The stage for one face, or ``None`` when it has nothing to do there."""
        return cls(services)

    def wanted(self, start: StreamStart) -> bool:
        """Whether this stream runs the stage."""
        return True

    def configure(self, start: StreamStart, options: RelayOptions) -> None:
        """Set what the relay is built with."""

    def transform(self, stream: PipelineStream) -> EventTransform | None:
        """What the stage does to the stream's events, if anything (its relay exists)."""
        return None

    def opened(self, stream: PipelineStream) -> None:
        """Act on the stream once its relay exists, before its head goes out."""

    def closing(self, stream: PipelineStream) -> None:
        """The stream is over; its record is not written yet."""

    def closed(self, stream: PipelineStream, record: StreamRecord) -> None:
        """The stream's record is written."""

    # -- the request, before any stream (the step: streamwarden.pipeline.step) --
    #
    # A request meets the stages before anything of it is forwarded: each
    # stage's request hooks run only if it overrides them, and only if it
    # is in the plan, so taking a stage's line out of the plan takes its
    # answers away too.

    def traced(self, request: IncomingRequest) -> RequestTrace | None:
        """Open the request's spans (first thing, so they cover its whole answer)."""
        return None

    async def answer(self, request: IncomingRequest) -> Answer | Serve | None:
        """Answer the request now, never forwarding it (a resume, a stop), or ``None``."""
        return None

    async def forwarding(self, request: IncomingRequest, forward: Forward) -> None:
        """A request that asks for a stream, about to be sent on: act on it (rewrite its body)."""
