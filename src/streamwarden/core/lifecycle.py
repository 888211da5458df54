"""A stream's lifecycle as one table: what each input does to it, and what the face does next.

As h11's ``_state.py`` is for HTTP, this is the one place where the
lifecycle of a relayed stream moves: every transition is a row of
:data:`TABLE`, and everything a face does about it follows from the
:class:`Next` of the phase it is in (:data:`NEXT`). The faces decide
nothing about cancel, drain or detach: they tell the relay what happened
and act on its answer.

Phases:

- ``streaming``: the client is there, the upstream (or app) is read;
- ``draining``: the client left on a route with ``on_client_gone: drain``:
  the upstream is read on for the meter, nothing is written;
- ``detached``: the client left a resumable stream (``detach``): it runs on
  into its journal for a resume;
- ``expiring``: a detached stream's ``resume_window`` ran out: the face
  asks whether a resumed client holds it;
- ``ended``: the stream has its end with its client there: its response
  is finished;
- ``broken``: the stream ended in an error with its client there, in a
  format whose clients do not raise on its error event
  (:attr:`~streamwarden.core.dialects.Dialect.error_event_raises`): after
  that event, its response is ended abnormally, as a broken upstream's
  would be without streamwarden;
- ``closed``: the stream is over and nobody reads it: the upstream is
  closed (the app stopped) at once.

What a client-gone input is depends on the route's policy
(:class:`Gone`), fixed when the stream opens: cancel, drain, or detach
(only for a stream that has a journal to run on into). One stream's
place in the table, and the moves its relay's inputs make, are its
:class:`Lifecycle`.
"""

from __future__ import annotations

from enum import Enum

from streamwarden.core.endings import ErrorCode
from streamwarden.core.meter import EndState, StreamMeter
from streamwarden.core.timers import Timers

__all__ = ["GONE_INPUT", "NEXT", "TABLE", "Gone", "Input", "Lifecycle", "Next", "Phase", "step"]


class Phase(Enum):
    STREAMING = "streaming"
    DRAINING = "draining"
    DETACHED = "detached"
    EXPIRING = "expiring"
    ENDED = "ended"
    BROKEN = "broken"
    CLOSED = "closed"


class Gone(Enum):
    """What a client leaving does to the stream (``on_client_gone``)."""

    CANCEL = "cancel"
    DRAIN = "drain"
    DETACH = "detach"


class Input(Enum):
    """What happens to a stream, as the lifecycle sees it."""

    GONE_CANCEL = "gone, cancel"
    GONE_DRAIN = "gone, drain"
    GONE_DETACH = "gone, detach"
    #: The client took no bytes for ``client_write_timeout``.
    TOO_SLOW = "too slow"
    #: The stream's owner stopped it (a ``DELETE``).
    STOP = "stop"
    #: The relay gave the stream its end state (its upstream's end, a limit, an error).
    ENDED = "ended"
    #: The relay ended the stream with an error event its client does not raise on.
    ENDED_UNHEARD = "ended, error unheard"
    #: A detached stream's window ran out.
    WINDOW_OUT = "window out"
    #: A resumed client holds it (for longer), or nobody does.
    HELD = "held"
    NOT_HELD = "not held"


class Next(Enum):
    """What the face does next."""

    #: Write what came, keep reading the upstream (or the app).
    READ = "read"
    #: The client is gone: keep reading the upstream, write nothing.
    READ_ON = "read on"
    #: Ask whether a resumed client holds the stream, and tell the relay.
    ASK_HOLD = "ask hold"
    #: Write what came and finish the client's response; then the upstream
    #: goes back if whole (the app is stopped if it is still sending).
    FINISH = "finish"
    #: Write what came, then end the client's response abnormally (no
    #: terminating chunk: the connection is closed, the app's response left
    #: unfinished), so that its client fails as it would directly.
    BREAK = "break"
    #: Nobody reads the stream: close the upstream (stop the app) now.
    CLOSE = "close"


#: How the client leaving is put to the table, by the route's policy.
GONE_INPUT = {
    Gone.CANCEL: Input.GONE_CANCEL,
    Gone.DRAIN: Input.GONE_DRAIN,
    Gone.DETACH: Input.GONE_DETACH,
}

_S, _DR, _DE, _EX, _EN, _BR, _CL = (
    Phase.STREAMING,
    Phase.DRAINING,
    Phase.DETACHED,
    Phase.EXPIRING,
    Phase.ENDED,
    Phase.BROKEN,
    Phase.CLOSED,
)

#: Every transition: (phase, input) -> (phase, the end state it records).
#: An input with no row leaves the phase as it is. (A stream whose terminal
#: event arrived is complete whatever happens afterwards: the relay ends it
#: ``completed`` before a client-gone input reaches the table.)
TABLE: dict[tuple[Phase, Input], tuple[Phase, EndState | None]] = {
    (_S, Input.GONE_CANCEL): (_CL, EndState.CLIENT_CANCELLED),
    (_S, Input.GONE_DRAIN): (_DR, None),
    (_S, Input.GONE_DETACH): (_DE, None),
    (_S, Input.TOO_SLOW): (_CL, EndState.CLIENT_TOO_SLOW),
    (_S, Input.STOP): (_CL, EndState.CLIENT_CANCELLED),
    (_S, Input.ENDED): (_EN, None),
    (_S, Input.ENDED_UNHEARD): (_BR, None),
    (_DR, Input.STOP): (_CL, EndState.CLIENT_CANCELLED),
    (_DR, Input.ENDED): (_CL, None),
    (_DR, Input.ENDED_UNHEARD): (_CL, None),
    (_DE, Input.STOP): (_CL, EndState.CLIENT_CANCELLED),
    (_DE, Input.ENDED): (_CL, None),
    (_DE, Input.ENDED_UNHEARD): (_CL, None),
    (_DE, Input.WINDOW_OUT): (_EX, None),
    (_EX, Input.HELD): (_DE, None),
    (_EX, Input.NOT_HELD): (_CL, EndState.DETACHED_EXPIRED),
    (_EX, Input.STOP): (_CL, EndState.CLIENT_CANCELLED),
    (_EX, Input.ENDED): (_CL, None),
    (_EX, Input.ENDED_UNHEARD): (_CL, None),
    # Its answer was whole when the client left (see above), or it had ended
    # and its last write found nobody: nobody reads it any more.
    (_EN, Input.GONE_CANCEL): (_CL, None),
    (_EN, Input.GONE_DRAIN): (_CL, None),
    (_EN, Input.GONE_DETACH): (_CL, None),
    (_EN, Input.TOO_SLOW): (_CL, None),
    (_BR, Input.GONE_CANCEL): (_CL, None),
    (_BR, Input.GONE_DRAIN): (_CL, None),
    (_BR, Input.GONE_DETACH): (_CL, None),
    (_BR, Input.TOO_SLOW): (_CL, None),
}

#: What the face does in each phase.
NEXT: dict[Phase, Next] = {
    _S: Next.READ,
    _DR: Next.READ_ON,
    _DE: Next.READ_ON,
    _EX: Next.ASK_HOLD,
    _EN: Next.FINISH,
    _BR: Next.BREAK,
    _CL: Next.CLOSE,
}


def step(phase: Phase, event: Input) -> tuple[Phase, EndState | None]:
    """The phase after ``event``, and the end state it records (``None``: none)."""
    return TABLE.get((phase, event), (phase, None))


class Lifecycle:
    """One stream's lifecycle: its phase, what a client leaving does, and the moves by the table.

    The :class:`~streamwarden.core.relay.Relay` puts its inputs to it; each
    move that records an end state records it in the stream's meter.
    """

    __slots__ = ("gone", "meter", "phase", "present", "timers", "window")

    def __init__(self, meter: StreamMeter, timers: Timers) -> None:
        self.meter = meter
        self.timers = timers
        self.phase = Phase.STREAMING
        #: What a client leaving does (``on_client_gone``; detach: :meth:`detach_for`).
        self.gone = Gone.CANCEL
        #: How long a detached stream runs on for a resume, in seconds.
        self.window = 0.0
        #: The client is there: it has not left, been cut as too slow, or been stopped.
        self.present = True

    @property
    def next(self) -> Next:
        """What the face does next (the table's answer to the last input)."""
        return NEXT[self.phase]

    def detach_for(self, window: float) -> None:
        """A gone client leaves the stream running into its journal for ``window`` seconds."""
        self.gone = Gone.DETACH
        self.window = window

    def client_gone(self, now: float, whole: bool) -> Next | None:
        """The client disconnected (``whole``: after the terminal event): what the face does now.

        By the :attr:`gone` policy: ``cancel`` ends the stream
        ``client_cancelled``; ``drain`` reads the upstream on, writes
        nothing, and a clean end is ``drained``, with its final usage
        metered; ``detach`` runs it on into its journal for a client that
        resumes, until its window runs out. Later upstream content counts
        as zombie tokens (unless someone resumes it). ``None``: nothing new.
        """
        was = self.phase
        self.present = False
        if was is Phase.ENDED or was is Phase.BROKEN or was is Phase.CLOSED:
            return None  # over already: the face finishes it as it would have
        if whole:  # an answer whose terminal event arrived is complete
            self.end(EndState.COMPLETED, now)
        elif self.gone is Gone.DETACH and self.timers.window_ends is None:
            self.timers.window_ends = now + self.window
        return self.to(GONE_INPUT[self.gone], now, was)

    def held(self, now: float, left: float | None) -> Next | None:
        """The answer to ``ASK_HOLD``: a resumed client holds the stream ``left`` more seconds."""
        if self.phase is not Phase.EXPIRING:
            return None
        if left is None or left <= 0:
            return self.to(Input.NOT_HELD, now, Phase.EXPIRING)
        self.timers.window_ends = now + left
        self.meter.resumed()
        return self.to(Input.HELD, now, Phase.EXPIRING)

    def stop(self, now: float) -> Next | None:
        """An explicit stop (``DELETE``) by the stream's owner: end it now."""
        answer = self.to(Input.STOP, now, self.phase)
        if answer is not None:
            self.present = False
        return answer

    def too_slow(self, now: float) -> Next | None:
        """The client did not take our writes within ``client_write_timeout``."""
        self.present = False
        return self.to(Input.TOO_SLOW, now, self.phase)

    def end(
        self, state: EndState, now: float, code: ErrorCode | None = None, unheard: bool = False
    ) -> None:
        """The stream has its end state (the first only, in the meter): the table's end.

        ``unheard``: it ended in an error event its client does not raise on.
        """
        self.meter.end(state, now, code)
        self.to(Input.ENDED_UNHEARD if unheard else Input.ENDED, now, self.phase)

    def to(self, event: Input, now: float, was: Phase) -> Next | None:
        """Move by the table; the face's next step if the phase changed (``None``: it did not)."""
        phase, state = step(self.phase, event)
        self.phase = phase
        if state is not None:
            self.meter.end(state, now)
        return NEXT[phase] if phase is not was else None
