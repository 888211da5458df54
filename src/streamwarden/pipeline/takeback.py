"""Usage injection's transforms: what the added option added taken back, or a habit watched.

The request went upstream with ``stream_options.include_usage`` added
(:mod:`streamwarden.core.usage` says when): :class:`UsageTakeBackTransform`
takes back exactly what that added, the usage chunk and each chunk's
``"usage": null``, after the relay has metered the usage. Or it went
unchanged, to learn what the upstream sends unasked: :class:`HabitSeen`
shows every event to the watch until it has learned.
"""

from __future__ import annotations

from streamwarden.core.dialects import Observation
from streamwarden.core.sse import Event, Frame
from streamwarden.core.transform import EventTransform, Passing, Stop
from streamwarden.core.usage import HabitWatch, TakeBack, UsageRole, without_usage_null

__all__ = ["HabitSeen", "UsageTakeBackTransform", "usage_transform"]


def usage_transform(usage: UsageRole) -> EventTransform | None:
    """The stream's part in usage injection, as a transform (``None``: none)."""
    if isinstance(usage, TakeBack):
        return UsageTakeBackTransform(usage)
    if isinstance(usage, HabitWatch):
        return HabitSeen(usage)
    return None


class UsageTakeBackTransform:
    """Takes back what the injected option added: the usage chunk, the ``"usage": null``."""

    __slots__ = ("_chunk", "_nulls", "stop")

    def __init__(self, take: TakeBack) -> None:
        self._chunk = take.chunk
        self._nulls = take.nulls
        self.stop: Stop | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        if self._chunk and seen.usage_only:
            return  # the client never asked for it: metered, never sent
        if self._nulls:
            raw = without_usage_null(frame.raw)
            if raw is not frame.raw:
                # The event too: a redaction re-serialises from its data,
                # which must not bring back the field.
                event = frame.event
                if event is not None:
                    data = without_usage_null(event.data.encode()).decode()
                    event = Event(event.event, data, event.id)
                frame = Frame(raw, event)
        out.append((frame, seen))

    def close(self, now: float, out: list[Passing]) -> None:
        return None

    def ending(self, error: bytes) -> bytes:
        return error


class HabitSeen:
    """Shows an unchanged stream's events to the watch of its upstream's usage habit."""

    __slots__ = ("_watch", "stop")

    def __init__(self, watch: HabitWatch) -> None:
        self._watch = watch
        self.stop: Stop | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        watch = self._watch
        if frame.event is not None and not watch.settled:
            watch.see(frame, seen, now)
        out.append((frame, seen))

    def close(self, now: float, out: list[Passing]) -> None:
        return None

    def ending(self, error: bytes) -> bytes:
        return error
