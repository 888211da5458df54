"""What a stage may do to one stream's events: the relay's side of the pipeline.

A stage of the pipeline (:mod:`streamwarden.pipeline`) may give a stream an
:class:`EventTransform`. The :class:`~streamwarden.core.relay.Relay` hands it
every whole frame after the dialect has read it and the relay has done its
own bookkeeping with what it read (usage, terminal, tool calls), and before
the frame is written; what the transform lets out goes to the next
transform of the stream, in the plan's order, then to the client. A stream
with no transform (the plain stream) takes none of this path: its frames
go out as they came, at no cost per event.

The core defines the shape only: the transforms themselves (output
filters' hold-back, usage take-back, the resume journal's ids) live beside
their stages, outside the core, which never imports them.
"""

from __future__ import annotations

from typing import Protocol

from streamwarden.core.dialects import Observation
from streamwarden.core.endings import ErrorCode
from streamwarden.core.sse import Frame

__all__ = ["EventTransform", "Passing", "Stop"]

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
