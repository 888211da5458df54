"""The live view of streams, with no I/O: what ``GET /streams`` and ``streamwarden top`` show.

One entry per open stream (its id, route, dialect, age, time to first
token, events and tokens so far, time since the last write to the client,
the client's state, and the tool calls open in it), and the end states of the streams that finished
in the last minute: what an operator looks at first when "streams hang".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from streamwarden.core.lifecycle import Phase
from streamwarden.core.meter import StreamRecord
from streamwarden.core.relay import Relay

__all__ = ["RECENT", "client_state", "recent_endings", "stream_view"]

#: The window of "recent" endings, in seconds.
RECENT = 60.0


def client_state(relay: Relay, paused: bool) -> str:
    """``connected``, ``paused`` (not reading), ``detached`` (kept for a resume),
    ``draining`` (gone, upstream read to its end) or ``gone``."""
    if relay.lifecycle.present:
        return "paused" if paused else "connected"
    phase = relay.phase
    if phase is Phase.DETACHED or phase is Phase.EXPIRING:
        return "detached"
    return "draining" if phase is Phase.DRAINING else "gone"


def stream_view(
    stream_id: str, route: str, relay: Relay, now: float, paused: bool
) -> dict[str, Any]:
    meter = relay.meter
    return {
        "id": stream_id,
        "route": route,
        "dialect": relay.dialect,
        "age_s": round(now - meter.started_at, 3),
        "ttft_s": None if meter.ttft is None else round(meter.ttft, 3),
        "events": meter.events_out,
        "tokens": meter.tokens_generated,
        "since_last_write_s": round(now - relay.timers.last_write, 3),
        "client": client_state(relay, paused),
        # The calls still open: a stream that hangs inside one says which
        # (the first 16; the count says how many).
        "tool_calls_open": relay.calls.open_calls(),
        "tool_calls_open_count": relay.calls.open_count,
    }


def recent_endings(records: Iterable[StreamRecord], now: float) -> dict[str, int]:
    """How the streams of the last :data:`RECENT` seconds ended, by end state."""
    counts: Counter[str] = Counter()
    for record in records:
        ended = record.meter.ended_at
        if ended is not None and now - ended <= RECENT:
            counts[str(record.meter.end_state)] += 1
    return dict(counts)
