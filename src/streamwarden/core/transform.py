"""What a stage may do to one stream's events: the relay's side of the pipeline.

A stage of the pipeline (:mod:`streamwarden.pipeline`) may give a stream an
:class:`EventTransform`. The :class:`~streamwarden.core.relay.Relay` hands it
every whole frame after the dialect has read it and the relay has done its
own bookkeeping with what it read (usage, terminal, tool calls), and before
the frame is written; what the transform lets out goes to the next
transform of the stream, in the plan's order, then to the client. A stream
with no transform (the plain stream) takes none of this path: its frames
go out as they came, at no cost per event. A stream's transforms, in the
plan's order, are its :class:`TransformChain`.

The core defines the shape only: the transforms themselves (output
filters' hold-back, usage take-back, the resume journal's ids) live beside
their stages, outside the core, which never imports them.
"""

from __future__ import annotations

from typing import Protocol

from streamwarden.core.dialects import Observation
from streamwarden.core.endings import ErrorCode
from streamwarden.core.meter import StreamMeter
from streamwarden.core.sse import Frame

__all__ = ["EventTransform", "Passing", "Stop", "TransformChain"]

#: A frame on its way out, with what the dialect read in it (``NOTHING`` for a
#: comment, or a frame the dialect reads nothing in). The relay meters the
#: text of what leaves the last transform, when it leaves.
Passing = tuple[Frame, Observation]

#: Why a transform ends the stream: the code of its error event and its reason.
Stop = tuple[ErrorCode, str]


class EventTransform(Protocol):
    """One stage's part in one stream's events (see the module docstring)."""

    #: Set once the stream must end now, with this error (a filter's block).
    stop: Stop | None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        """A whole frame arrived (a comment too: its ``event`` is None); append what leaves."""

    def close(self, now: float, out: list[Passing]) -> None:
        """The stream's text is over (its end, or an ending): append all that still waits."""

    def ending(self, error: bytes) -> bytes:
        """The stream's synthesized error event on its way out: it, as it goes."""


class TransformChain:
    """A stream's transforms in the plan's order: a frame goes through each, then out.

    The meter counts the text of what leaves the last one, when it leaves
    (``delivered``: to a client still there).
    """

    __slots__ = ("meter", "transforms")

    def __init__(self, transforms: tuple[EventTransform, ...], meter: StreamMeter) -> None:
        self.transforms = transforms
        self.meter = meter

    def through(
        self, items: list[Passing], now: float, out: list[Frame], delivered: bool, first: int = 0
    ) -> int:
        """Frames through the transforms from the ``first`` on; what leaves the last to ``out``.

        Returns how many of the frames it added carry an event.
        """
        transforms = self.transforms
        for index in range(first, len(transforms)):
            transform = transforms[index]
            after: list[Passing] = []
            for frame, seen in items:
                transform.event(frame, seen, now, after)
            items = after
            if not items:
                return 0
        meter = self.meter
        events = 0
        for frame, seen in items:
            if frame.event is not None:
                events += 1
            if seen.text:
                meter.content(seen.text, now, delivered=delivered)
            out.append(frame)
        return events

    def close(self, now: float, out: list[Frame], delivered: bool) -> int:
        """The text ended: all that waits in each transform goes through the ones after it."""
        events = 0
        transforms = self.transforms
        for index in range(len(transforms)):
            released: list[Passing] = []
            transforms[index].close(now, released)
            if released:
                events += self.through(released, now, out, delivered, index + 1)
        return events

    @property
    def stop(self) -> Stop | None:
        """The first transform's reason to end the stream now, if one has one."""
        for transform in self.transforms:
            stop = transform.stop
            if stop is not None:
                return stop
        return None

    def ending(self, error: bytes) -> bytes:
        """The stream's error event through each transform (a journal records it for a resume)."""
        for transform in self.transforms:
            error = transform.ending(error)
        return error
