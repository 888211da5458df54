"""A relayed stream's timers: when the relay must next be polled, and which timer is due.

Five timers run on a stream, each a limit or a phase of its life: the
process's drain, a detached stream's resume window, the stream's maximum
duration, the upstream's idle timeout and the keep-alive. The
:class:`~streamwarden.core.relay.Relay` moves their marks as bytes pass
(:attr:`Timers.last_upstream`, :attr:`Timers.last_write`) and, on a poll,
asks which one is due; what a due timer does to the stream is the relay's
(an ending says :data:`ENDING`'s code).

Every mark but the drain only ever moves later, so :meth:`Timers.next`
only ever moves later too: the faces keep one timer per stream, which may
fire early but never late, and wake it only after a drain.
"""

from __future__ import annotations

from enum import Enum

from streamwarden.core.endings import ErrorCode

__all__ = ["ENDING", "Timer", "Timers"]


class Timer(Enum):
    """The timers, in the order a poll looks at them: the first one due acts."""

    DRAIN = "drain"
    #: A detached stream's ``resume_window`` ran out.
    WINDOW = "window"
    DURATION = "duration"
    IDLE = "idle"
    KEEPALIVE = "keepalive"


#: The timers that end the stream, with the code of its error event (unless
#: its answer was already whole).
ENDING = {
    Timer.DRAIN: ErrorCode.SHUTTING_DOWN,
    Timer.DURATION: ErrorCode.DURATION_EXCEEDED,
    Timer.IDLE: ErrorCode.UPSTREAM_TIMEOUT,
}


class Timers:
    """One stream's timers. A duration of 0 disables its timer."""

    __slots__ = (
        "_duration_ends",
        "_idle",
        "_keepalive",
        "drain_at",
        "last_upstream",
        "last_write",
        "window_ends",
    )

    def __init__(
        self, *, started_at: float, now: float, duration: float, idle: float, keepalive: float
    ) -> None:
        self._duration_ends = started_at + duration if duration > 0 else None
        self._idle = idle
        self._keepalive = keepalive
        #: When bytes last came from the upstream, and last went to the client
        #: (an event or a keep-alive): the response's head went out just now.
        self.last_upstream = now
        self.last_write = now
        #: The process is draining: the stream runs on until then, no longer.
        self.drain_at: float | None = None
        #: A detached stream runs on into its journal until then, unless
        #: someone resumes it.
        self.window_ends: float | None = None

    def drain_by(self, deadline: float) -> None:
        """The process drains: the stream ends by ``deadline`` (the one mark that moves sooner)."""
        if self.drain_at is None or deadline < self.drain_at:
            self.drain_at = deadline

    def next(self, keepalive: bool) -> float | None:
        """When the next timer falls due (``None``: none runs); ``keepalive``: a client is there."""
        times: list[float] = []
        if self.drain_at is not None:
            times.append(self.drain_at)
        if self.window_ends is not None:
            times.append(self.window_ends)
        if self._duration_ends is not None:
            times.append(self._duration_ends)
        if self._idle > 0:
            times.append(self.last_upstream + self._idle)
        if keepalive and self._keepalive > 0:
            times.append(self.last_write + self._keepalive)
        return min(times) if times else None

    def due(self, now: float, keepalive: bool) -> Timer | None:
        """The first timer due at ``now``, in :class:`Timer`'s order (``None``: none is)."""
        if self.drain_at is not None and now >= self.drain_at:
            return Timer.DRAIN
        if self.window_ends is not None and now >= self.window_ends:
            return Timer.WINDOW
        if self._duration_ends is not None and now >= self._duration_ends:
            return Timer.DURATION
        if self._idle > 0 and now >= self.last_upstream + self._idle:
            return Timer.IDLE
        if keepalive and self._keepalive > 0 and now >= self.last_write + self._keepalive:
            return Timer.KEEPALIVE
        return None
