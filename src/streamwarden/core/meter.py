"""Per-stream accounting: timings, bytes, events, tokens, and how the stream ended.

The relay feeds a :class:`StreamMeter` as it forwards a stream; the faces
publish the finished record (metrics, the stream's log line). Nothing here
reads a clock: every method takes the time from its caller.

Token counts. The provider's own count of generated tokens (``usage``) is
used when the stream reached its terminal event, where that count is final.
A count seen before (Anthropic's ``message_start``, Gemini's running total,
vLLM's per-chunk usage) is only a lower bound, so a stream cut short counts
the larger of it and the estimate. Otherwise tokens are estimated from the
content each event carries (answer text, reasoning, tool-call arguments):
one token for an event of up to 12 UTF-8 bytes, else ``utf8_bytes // 4``.
Most servers (OpenAI, vLLM, TGI, Ollama) send one token per event, and a
single token is almost never longer than 12 bytes (a long word, or four
CJK characters), so the estimate is exact for them; longer, multi-token
chunks (Anthropic, Gemini) count about four bytes a token, the usual
figure for English text.

Tokens *delivered* are those written to the client; *zombie* tokens arrived
from the upstream after the client had gone. When part of the content never
reached the client, the generated count is split between delivered and
zombie in proportion to the estimate. A completed stream with usage
therefore has delivered == generated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from streamwarden.core.filters import FilterStats
    from streamwarden.core.toolcalls import ToolCalls

__all__ = ["EndState", "GapCounts", "GapObserver", "StreamMeter", "StreamRecord", "estimate_tokens"]


class EndState(StrEnum):
    """How a stream ended; every stream gets exactly one."""

    COMPLETED = "completed"
    CLIENT_CANCELLED = "client_cancelled"
    UPSTREAM_TRUNCATED = "upstream_truncated"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    CLIENT_TOO_SLOW = "client_too_slow"
    LIMIT_EXCEEDED = "limit_exceeded"
    SHUTDOWN = "shutdown"
    #: The client left, and the upstream was read to its end for metering
    #: (``on_client_gone: drain``).
    DRAINED = "drained"
    #: The client left a resumable stream and nobody resumed it within
    #: ``resume_window`` (``on_client_gone: detach``).
    DETACHED_EXPIRED = "detached_expired"
    #: An output filter with action ``block`` matched: ``content_blocked``.
    BLOCKED = "blocked"


# The longest event text still counted as a single token.
_ONE_TOKEN_BYTES: Final = 12


#: ``str.isascii`` as a function: the compiled build calls a method of a
#: builtin by looking it up by name, where this is one direct call.
_IS_ASCII: Final = str.isascii


def estimate_tokens(text: str) -> int:
    """Estimated tokens in one content event's text (see the module docstring)."""
    size = len(text) if _IS_ASCII(text) else len(text.encode("utf-8", "replace"))
    return 1 if size <= _ONE_TOKEN_BYTES else size // 4


class GapCounts:
    """Bucket counts of the gaps between content events: the one observation made per event.

    Compiled with the meter, so the meter counts a gap with one native call.
    Through a Python callable (two interpreted frames and a ``bisect``) the
    same count was about a tenth of the sidecar's own instructions per event.
    The metrics' histogram (``observation.metrics.GapHistogram``) reads it
    at a scrape. Only the event loop writes; a scrape from another thread
    reads plain integers.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        #: Upper bounds, ascending; a gap counts in the first bucket whose bound is >= it.
        self.bounds: list[float] = sorted(bounds)
        #: One count per bucket (not cumulative), the last one for +Inf.
        self.counts: list[int] = [0] * (len(self.bounds) + 1)
        #: The sum of every gap counted.
        self.total = 0.0

    def observe(self, value: float) -> None:
        bounds = self.bounds
        low = 0
        high = len(bounds)
        while low < high:  # bisect_left: four steps over a dozen bounds
            middle = (low + high) // 2
            if bounds[middle] < value:
                low = middle + 1
            else:
                high = middle
        counts = self.counts
        # Not ``counts[low] += 1``: mypyc adds to a list item as to any object.
        counts[low] = counts[low] + 1
        self.total += value


#: What the meter tells each gap between content events: the metrics' counts
#: (native), or any callable.
GapObserver = GapCounts | Callable[[float], None]


class StreamMeter:
    """The running record of one stream."""

    __slots__ = (
        "_estimate_in",
        "_estimate_zombie",
        "_gap_counts",
        "_gap_observer",
        "_last_content_at",
        "_resumed",
        "bytes_in",
        "bytes_out",
        "cancel_propagation",
        "content_events_in",
        "content_events_out",
        "end_state",
        "ended_at",
        "error_code",
        "events_in",
        "events_out",
        "filters",
        "first_content_at",
        "gap_count",
        "gap_max",
        "gap_sum",
        "input_tokens",
        "keepalives",
        "started_at",
        "tool_calls",
        "upstream_reported_error",
        "usage_final",
        "usage_tokens",
    )

    def __init__(self, started_at: float, gap_observer: GapObserver | None = None) -> None:
        #: When the client's request arrived.
        self.started_at = started_at
        #: When the first content event was written to the client.
        self.first_content_at: float | None = None
        self._last_content_at: float | None = None
        self.ended_at: float | None = None
        self.events_in = 0
        self.events_out = 0
        self.content_events_in = 0
        self.content_events_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.keepalives = 0
        self.gap_count = 0
        self.gap_sum = 0.0
        self.gap_max = 0.0
        #: The provider's latest count of generated tokens, if it sent one.
        self.usage_tokens: int | None = None
        #: The stream reached its terminal event: ``usage_tokens`` is final.
        self.usage_final = False
        #: The provider's count of the prompt's tokens, if it sent one.
        self.input_tokens: int | None = None
        self._estimate_in = 0
        self._estimate_zombie = 0
        self._resumed = False
        self.end_state: EndState | None = None
        #: The code of the synthesized error event, if one was written.
        self.error_code: str | None = None
        #: The upstream reported an error itself, inside the stream.
        self.upstream_reported_error = False
        #: Seconds from noticing the client had gone to the upstream being closed.
        self.cancel_propagation: float | None = None
        # The metrics' counts are called natively; any other callable (a
        # test's list.append) through Python.
        self._gap_counts = gap_observer if isinstance(gap_observer, GapCounts) else None
        self._gap_observer = None if isinstance(gap_observer, GapCounts) else gap_observer
        #: What the route's output filters did (``None``: the route has none).
        self.filters: FilterStats | None = None
        #: The stream's tool calls (``None``: it had none).
        self.tool_calls: ToolCalls | None = None

    def content(self, text: str, now: float, *, delivered: bool) -> None:
        """Count one content event, delivered to the client or arrived too late."""
        tokens = estimate_tokens(text)
        self.content_events_in += 1
        self._estimate_in += tokens
        if not delivered:
            if not self._resumed:
                self._estimate_zombie += tokens
            return
        self.content_events_out += 1
        last = self._last_content_at
        if last is None:
            self.first_content_at = now
        else:
            gap = now - last
            self.gap_count += 1
            self.gap_sum += gap
            if gap > self.gap_max:
                self.gap_max = gap
            counts = self._gap_counts
            if counts is not None:
                counts.observe(gap)
            elif self._gap_observer is not None:
                self._gap_observer(gap)
        self._last_content_at = now

    def resumed(self) -> None:
        """A client resumed: what arrived after the client left (and arrives) reached it."""
        self._estimate_zombie = 0
        self._resumed = True

    def end(self, state: EndState, now: float, error_code: str | None = None) -> None:
        """Record the end state. Only the first call counts."""
        if self.end_state is None:
            self.end_state = state
            self.error_code = None if error_code is None else str(error_code)
            self.ended_at = now

    @property
    def ttft(self) -> float | None:
        """Seconds from the request to the first content event written to the client."""
        if self.first_content_at is None:
            return None
        return self.first_content_at - self.started_at

    @property
    def duration(self) -> float | None:
        if self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    @property
    def _final_usage(self) -> int | None:
        return self.usage_tokens if self.usage_final else None

    @property
    def tokens_method(self) -> str:
        """``"usage"`` when the provider's final count is known, else ``"estimate"``."""
        return "estimate" if self._final_usage is None else "usage"

    @property
    def tokens_source(self) -> str:
        """Where the token counts come from (the metrics' ``source`` label).

        ``provider``: the provider's final count (the stream reached its
        terminal event with usage; an explicit zero stays zero);
        ``provider_partial``: only a running count arrived, a lower bound
        (the larger of it and the estimate is used); ``estimated``: no
        count at all.
        """
        if self._final_usage is not None:
            return "provider"
        return "estimated" if self.usage_tokens is None else "provider_partial"

    @property
    def tokens_generated(self) -> int:
        usage = self._final_usage
        if usage is not None:
            return usage
        return max(self.usage_tokens or 0, self._estimate_in)

    @property
    def tokens_zombie(self) -> int:
        if not self._estimate_zombie:
            return 0
        # The generated count split in proportion to the estimate; exactly
        # the zombie estimate when no usage was reported.
        return round(self.tokens_generated * self._estimate_zombie / self._estimate_in)

    @property
    def tokens_delivered(self) -> int:
        return self.tokens_generated - self.tokens_zombie

    def as_record(self) -> dict[str, Any]:
        """A flat, JSON-ready summary for the stream's log line."""
        return {
            "end_state": str(self.end_state) if self.end_state else None,
            "error_code": self.error_code,
            "upstream_reported_error": self.upstream_reported_error,
            "ttft_s": _round(self.ttft),
            "duration_s": _round(self.duration),
            "events_in": self.events_in,
            "events_out": self.events_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "content_events_in": self.content_events_in,
            "content_events_out": self.content_events_out,
            "tokens_generated": self.tokens_generated,
            "tokens_delivered": self.tokens_delivered,
            "tokens_zombie": self.tokens_zombie,
            "tokens_method": self.tokens_method,
            "tokens_source": self.tokens_source,
            "inter_token_gap_max_s": _round(self.gap_max),
            "inter_token_gap_mean_s": _round(self.gap_sum / self.gap_count)
            if self.gap_count
            else None,
            "keepalives": self.keepalives,
            "cancel_propagation_s": _round(self.cancel_propagation),
            "tool_calls": None if self.tool_calls is None else self.tool_calls.record(),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass(slots=True)
class StreamRecord:
    """One finished stream, as either face publishes it to metrics and logs."""

    stream_id: str
    #: The matched route prefix, never the raw path (metrics label).
    route: str
    method: str
    #: The request path without its query, for the log line only.
    path: str
    status: int
    dialect: str
    meter: StreamMeter
