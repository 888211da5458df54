"""The request step: what both faces do with a request before anything of it is forwarded.

A face describes the request (:class:`~streamwarden.pipeline.request.IncomingRequest`),
opens its spans with :meth:`RequestStep.traced` (telemetry on), and asks
:meth:`RequestStep.decide` what to do with it. In order:

1. the stages that answer requests themselves (a resume or an owner's
   stop, :class:`~streamwarden.pipeline.resume.ResumeJournal`) may answer
   it, never forwarding it; a stream answered (a resume) takes a stream
   slot as the stream it resumes did, unless that stream still runs here
   and holds its own (a stream read on after its client left keeps it);
2. whether it asks for a stream (``Accept``, ``alt=sse``, ``"stream":
   true`` in the body's first bytes, read when the face reads them anyway
   or when a slot depends on them);
3. a request that asks for a stream meets the stages that act on it on
   its way (usage injection's rewrite), then takes one of
   ``max_concurrent_streams`` or is refused.

The rules are here once; the faces read bytes and write answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.dialects import asks_for_stream
from streamwarden.core.messages import refusal_message
from streamwarden.core.refusals import RefusalKind
from streamwarden.observation.register import Slot, StreamRegister
from streamwarden.pipeline.request import (
    Answer,
    AnswerWriter,
    Decision,
    Forward,
    IncomingRequest,
    RequestRefused,
    Serve,
)
from streamwarden.pipeline.stage import Stage

if TYPE_CHECKING:
    from streamwarden.observation.telemetry import RequestTrace

__all__ = ["RequestStep", "SessionSlots"]

#: Most request paths whose resolved settings are kept (past it: resolved
#: per request, so a client inventing paths cannot grow the map).
ROUTES_KEPT = 256


def _overriding(stages: Sequence[Stage], hook: str) -> tuple[Stage, ...]:
    """The stages that do something in ``hook`` (the others cost a request nothing)."""
    default = getattr(Stage, hook)
    return tuple(stage for stage in stages if getattr(type(stage), hook) is not default)


class RequestStep:
    """One face's request step, over the stages of its pipeline."""

    __slots__ = ("_answering", "_forwarding", "_register", "_routes", "_settings", "_tracing")

    def __init__(
        self, settings: Settings, stages: Sequence[Stage], register: StreamRegister[Any]
    ) -> None:
        self._settings = settings
        self._register = register
        self._tracing = _overriding(stages, "traced")
        self._answering = _overriding(stages, "answer")
        self._forwarding = _overriding(stages, "forwarding")
        self._routes: dict[str, ResolvedRoute] = {}

    def route(self, path: str) -> ResolvedRoute:
        """The path's settings: resolved once per path (a few hundred at most), then shared."""
        route = self._routes.get(path)
        if route is None:
            route = self._settings.for_path(path)
            if len(self._routes) < ROUTES_KEPT:
                self._routes[path] = route
        return route

    def traced(self, request: IncomingRequest) -> RequestTrace | None:
        """Open the request's spans (kept on ``request.trace``), or ``None``: telemetry off."""
        for stage in self._tracing:
            trace = stage.traced(request)
            if trace is not None:
                request.trace = trace
                return trace
        return None

    async def decide(self, request: IncomingRequest) -> Decision:
        """Answer now, or forward: see the module's docstring for the order."""
        for stage in self._answering:
            answered = await stage.answer(request)
            if answered is not None:
                return self._holding_a_slot(answered)
        limit = self._settings.max_concurrent_streams
        forward = Forward(asks_for_stream(request.header("accept"), request.query_string, b""))
        body = request.body
        if body is not None and (not body.lazy or (limit and not forward.asks_for_stream)):
            try:
                forward.body_start = await body.start()
            except RequestRefused as refused:
                return Answer.refused(refused.kind, **refused.values)
            if not forward.asks_for_stream:
                forward.asks_for_stream = asks_for_stream(None, "", forward.body_start)
        if request.trace is not None:
            request.trace.named_model(forward.body_start)
        if not forward.asks_for_stream:
            return forward
        for stage in self._forwarding:
            await stage.forwarding(request, forward)
        slot = self.stream_slot()
        if slot is None:
            return Answer.refused(RefusalKind.TOO_MANY_STREAMS, limit=limit)
        forward.slot = slot
        return forward

    @property
    def max_concurrent_streams(self) -> int:
        return self._settings.max_concurrent_streams

    def stream_slot(self) -> Slot | None:
        """One of ``max_concurrent_streams`` for a stream about to be asked of the upstream
        (a request's, a WebSocket's ``response.create``), or ``None``: all are held."""
        return self._register.admit(self._settings.max_concurrent_streams)

    def _holding_a_slot(self, answered: Answer | Serve) -> Answer | Serve:
        """A stream answered (a resume) holds a slot while it is served, as its original did.

        Unless the original still runs here, holding its slot: the slots
        bound the generations running upstream, and a resume starts none.
        """
        if isinstance(answered, Answer) or answered.slot_held:
            return answered
        slot = self.stream_slot()
        if slot is None:
            limit = self._settings.max_concurrent_streams
            return Answer.refused(RefusalKind.TOO_MANY_STREAMS, limit=limit)
        run = answered.run

        async def held(writer: AnswerWriter) -> object:
            try:
                return await run(writer)
            finally:
                slot.release()

        return Serve(held, answered.write_timeout)


class SessionSlots:
    """The ``max_concurrent_streams`` places one WebSocket session's responses hold, either face.

    Each ``response.create`` takes one as an HTTP stream does
    (:meth:`RequestStep.stream_slot`: the one rule), or is refused with an
    ``error`` message in the shape of its dialect's error event. Places are
    alike: one goes back as each of the session's streams is recorded, and
    whatever is still held (queued responses) at the session's end.
    """

    __slots__ = ("_dialect", "_path", "_slots", "_step")

    def __init__(self, step: RequestStep, dialect: str, path: str) -> None:
        self._step = step
        self._dialect = dialect
        self._path = path
        self._slots: list[Slot] = []

    def admit(self) -> str | None:
        """A place for one more response (``None``), else the ``error`` message refusing it.

        The :class:`~streamwarden.core.messages.MessageSession`'s ``admit``.
        """
        slot = self._step.stream_slot()
        if slot is not None:
            self._slots.append(slot)
            return None
        refused = RefusalKind.TOO_MANY_STREAMS.refusal
        message = refused.message.format(limit=self._step.max_concurrent_streams)
        return refusal_message(self._dialect, self._path, refused.code, message)

    def stream_finished(self) -> None:
        """One of the session's streams was recorded: a place goes back."""
        if self._slots:
            self._slots.pop().release()

    def release(self) -> None:
        """The session is over: every place its responses still held goes back."""
        for slot in self._slots:
            slot.release()
        self._slots.clear()
