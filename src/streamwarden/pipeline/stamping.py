"""The resume journal's transform: every event numbered and stored as it goes out.

On a resumable stream (``on_client_gone: detach``) every whole event gets
an ``id: <stream id>.<seq>`` field of ours and goes into the stream's
:class:`~streamwarden.core.journal.Journal` (a frame that dispatches no
event loses its ``id`` lines: they would still set the client's last event
id), and so does the stream's synthesized error event, so that a resumed
client ends the way the stream ended. A stream that ended without its
terminal event and without an error event of its own (nobody resumed it
in time, its owner stopped it, the face cut it) has its record sealed with
one (:meth:`JournalStamps.seal`): a resumed client is never handed a cut
answer as if it were whole.
"""

from __future__ import annotations

from streamwarden.core.dialects import Observation
from streamwarden.core.endings import ErrorCode
from streamwarden.core.journal import Journal, strip_ids
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Relay
from streamwarden.core.sse import Frame
from streamwarden.core.transform import Passing, Stop

__all__ = ["JournalStamps"]

# What a resumed client is told of a stream whose end wrote no error event.
_SEALS: dict[EndState, tuple[ErrorCode, str]] = {
    EndState.DETACHED_EXPIRED: (
        ErrorCode.RESUME_EXPIRED,
        "the stream was closed: nobody resumed it within resume_window",
    ),
    EndState.CLIENT_CANCELLED: (ErrorCode.RESUME_EXPIRED, "the stream was stopped"),
    EndState.SHUTDOWN: (ErrorCode.SHUTTING_DOWN, "the proxy shut down"),
}
_SEAL_OTHER = (ErrorCode.UPSTREAM_ERROR, "the stream ended before its answer")


class JournalStamps:
    """One resumable stream's journal, as an event transform of its stage."""

    __slots__ = ("journal", "stop")

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.stop: Stop | None = None

    def event(self, frame: Frame, seen: Observation, now: float, out: list[Passing]) -> None:
        if frame.event is None:
            out.append((Frame(strip_ids(frame.raw), None), seen))
        else:
            out.append((Frame(self.journal.record(frame.raw), frame.event), seen))

    def close(self, now: float, out: list[Passing]) -> None:
        return None

    def ending(self, error: bytes) -> bytes:
        return self.journal.record(error)  # a resumed client must end the way this stream ended

    def seal(self, relay: Relay) -> None:
        """End the record with an error event if the stream's end wrote none.

        Nothing goes to this stream's own client.
        """
        meter = relay.meter
        state = meter.end_state
        if (
            relay.terminal_seen
            or meter.error_code is not None
            or state in (None, EndState.COMPLETED, EndState.DRAINED)
        ):
            return
        code, reason = _SEALS.get(state, _SEAL_OTHER)
        self.journal.record(relay.rules.error_event(code, f"streamwarden: {reason} ({code})"))
