"""The stream pipeline: what runs on every stream, decided once, and run alike by both faces.

:data:`STAGES` is the plan: the capabilities a stream can have, one module
each, in the order they act. A face builds one :class:`Pipeline` (the
sidecar per process, the middleware per instance); for each response
that is a stream it calls :meth:`Pipeline.open` with what it knows
(:class:`~streamwarden.pipeline.stage.StreamStart`), which picks the
stages this stream runs, builds its sans-I/O
:class:`~streamwarden.core.relay.Relay` with what they configure, and lets
them act on it; and at its end, whatever ended it, :meth:`Pipeline.finish`,
which runs the one end every stream has (:class:`~streamwarden.pipeline.end.StreamEnd`)
with the stages' closing hooks in it. What stays in a face is its I/O:
moving bytes between the relay and its client and upstream (or app),
its timers, and its own cleanup.

A new capability is a module with a :class:`~streamwarden.pipeline.stage.Stage`
subclass and a line in :data:`STAGES`; both faces run it, and the README's
parity table (``python -m streamwarden.pipeline``) lists it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Generic, TypeVar

from streamwarden.core.lifecycle import Gone
from streamwarden.core.meter import StreamMeter, StreamRecord
from streamwarden.core.relay import Relay
from streamwarden.core.transform import TransformChain
from streamwarden.observation.register import StreamRegister
from streamwarden.pipeline.end import StreamEnd, StreamIdentity
from streamwarden.pipeline.filters import OutputFilters
from streamwarden.pipeline.keepalive import KeepAlive
from streamwarden.pipeline.limits import StreamLimits
from streamwarden.pipeline.metering import Metering
from streamwarden.pipeline.resume import ResumeJournal
from streamwarden.pipeline.stage import (
    Face,
    FaceServices,
    PipelineStream,
    RelayOptions,
    Stage,
    StreamStart,
)
from streamwarden.pipeline.step import RequestStep
from streamwarden.pipeline.telemetry import Telemetry
from streamwarden.pipeline.usage import UsageTakeBack

__all__ = [
    "STAGES",
    "Face",
    "FaceServices",
    "Pipeline",
    "PipelineStream",
    "RelayOptions",
    "Stage",
    "StreamStart",
]

#: The plan: every stage a stream can run, in the order they act.
STAGES: list[type[Stage]] = [
    KeepAlive,
    StreamLimits,
    Metering,
    UsageTakeBack,
    OutputFilters,
    ResumeJournal,
    Telemetry,
]

S = TypeVar("S")

#: What an open stream keeps of its response's headers: nothing (shared).
_NO_HEADERS: MappingProxyType[str, str] = MappingProxyType({})


class Pipeline(Generic[S]):
    """One face's pipeline: its stages, built once, and the end of its streams.

    ``S`` is the face's entry in its register (the sidecar's
    ``ActiveStream``, the middleware's responder).
    """

    __slots__ = ("end", "on_open", "register", "stages", "step")

    def __init__(
        self,
        services: FaceServices,
        register: StreamRegister[S],
        stages: Sequence[type[Stage]] | None = None,
    ) -> None:
        self.register = register
        self.end: StreamEnd[S] = StreamEnd(register, services.metrics)
        built = (kind.build(services) for kind in (STAGES if stages is None else stages))
        #: The stages this face runs (those with something to do here).
        self.stages: tuple[Stage, ...] = tuple(stage for stage in built if stage is not None)
        #: What the face does with each request before anything of it is forwarded.
        self.step = RequestStep(services.settings, self.stages, register)
        #: Called with each stream's meter as it opens, once its stages have
        #: acted on it: the register's listeners see streams end, these see
        #: them begin (the engine watch counts the tokens of streams in flight
        #: by them).
        self.on_open: list[Callable[[StreamMeter], None]] = []

    def open(self, start: StreamStart) -> PipelineStream:
        """A new stream: its stages picked, its relay built, and the stages acting on it."""
        planned = tuple(stage for stage in self.stages if stage.wanted(start))
        route, plan = start.route, start.plan
        options = RelayOptions(
            max_event_bytes=route.limits.max_event_bytes,
            max_tool_arguments_bytes=route.limits.max_tool_arguments_bytes,
            max_tool_arguments_depth=route.limits.max_tool_arguments_depth,
        )
        for stage in planned:
            stage.configure(start, options)
        relay = Relay(
            options.limits(),
            started_at=start.started_at,
            now=start.now,
            path=start.path,
            content_type=plan.content_type,
            headers=start.response_headers,
            dialect=route.dialect,
            gap_observer=options.gap_observer,
            framing=plan.framing,
        )
        # What a client leaving does: cancel, or drain; detach is the resume
        # stage's, for a stream it journals.
        relay.lifecycle.gone = Gone.DRAIN if route.on_client_gone == "drain" else Gone.CANCEL
        stream = PipelineStream(start, relay, self.register.next_id(), planned)
        # What each stage does to the stream's events, in the plan's order
        # (a plain stream: none, and the relay's path of every frame is bare).
        transforms = [stage.transform(stream) for stage in planned]
        given = tuple(t for t in transforms if t is not None)
        relay.chain = TransformChain(given, relay.meter) if given else None
        for stage in planned:
            stage.opened(stream)
        for callback in self.on_open:
            callback(relay.meter)
        # The request's headers and query (its credentials among them) were for
        # the stages' opening (a resumable stream's owner), the response's for
        # the relay's framing: not kept for its life.
        stream.start = replace(
            start, request_headers=(), response_headers=_NO_HEADERS, query_string=""
        )
        return stream

    def finish(self, entry: S, stream: PipelineStream, now: float) -> StreamRecord:
        """The stream is over (the face's own cleanup done): its one end, with its stages'."""
        start = stream.start
        identity = StreamIdentity(
            stream.stream_id, start.route.route, start.method, start.path, start.status
        )
        return self.end.publish(entry, stream, identity, now=now)
