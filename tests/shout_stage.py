"""A stage written the way a new capability is: one module, and one line in the plan.

:class:`Shout` upper-cases the text of every event, in whatever dialect the
stream speaks, through the stage API alone (:meth:`~streamwarden.pipeline.Stage.transform`):
the dialect says where an event's text is and writes it back, the relay
runs the transform in both faces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamwarden.core.sse import Frame, with_data
from streamwarden.pipeline import PipelineStream, Stage

if TYPE_CHECKING:
    from streamwarden.core.dialects import Observation
    from streamwarden.core.relay import Relay
    from streamwarden.core.transform import EventTransform, Passing, Stop


class Shout(Stage):
    __slots__ = ()

    name = "shout"
    summary = "every text delta upper-cased"

    def transform(self, stream: PipelineStream) -> EventTransform:
        return _Upper(stream.relay)


class _Upper:
    __slots__ = ("_relay", "stop")

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self.stop: Stop | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        event = frame.event
        if event is not None and seen.text:
            dialect = self._relay.rules
            parts = [part.upper() for part in dialect.filter_text(event, False)]
            data = dialect.rewrite_text(event, False, parts)
            frame = Frame(with_data(frame.raw, data, lines=self._relay.framing == "lines"), event)
        out.append((frame, seen))

    def close(self, now: float, out: list[Passing]) -> None:
        return None

    def ending(self, error: bytes) -> bytes:
        return error
