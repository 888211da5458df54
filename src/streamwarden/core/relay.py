"""The per-stream state machine that both faces drive, with no I/O.

A face (the aiohttp sidecar, the ASGI middleware) creates one
:class:`Relay` per streamed response and moves bytes and time through it:

- upstream bytes in (``feed``), upstream end or break (``upstream_eof``,
  ``upstream_failed``), the client leaving or stalling (``client_gone``,
  ``client_too_slow``), the process draining (``shutdown``);
- the clock, through ``poll(now)``, which it calls no later than
  ``deadline``.

Each call returns the bytes to write to the client, possibly empty: whole
upstream frames exactly as received (a partial event is held back until
its last byte arrives), keep-alive comments, or one synthesized error
event. Once ``done`` is true the face finishes the client response cleanly
and closes the upstream. The relay decides the end state (exactly one per
stream) and records everything in its :class:`~streamwarden.core.meter.StreamMeter`.

Every rule about how a stream ends lives here: which failures produce an
error event, with which code, and that a stream whose terminal event was
already delivered is complete whatever happens afterwards.

On a route with output filters, events go through a
:class:`~streamwarden.core.filters.Holdback` on their way out: an event whose
text could begin a match waits (whole, with the events behind it) until
the match is ruled out or made, and a redacted event is re-serialised by
its dialect with only its text changed. Keep-alives still go out between
whole events, and the journal and the meter see the events as the client
gets them, when it gets them. A summary event that repeats whole texts
(the Responses API's ``*.done`` events) has each of them filtered on its
own, in one piece, never as more of the stream's text. A route without
filters takes none of this path.

Tool calls (:mod:`streamwarden.core.toolcalls`): what a dialect reads of its
tool calls is followed to each call's close. A close whose arguments are
not a JSON object is replaced by ``tool_call_invalid`` (it is checked
before it is written: nothing after it reaches the client), and arguments
held past ``max_tool_arguments_bytes``, or nested past
``max_tool_arguments_depth``, end the stream ``tool_call_too_large`` in
place of the event that went over. A stream that ends for any other reason
while a call is open says ``tool_call_truncated`` instead of its own code
(its end state stays its own), and names every call it broke. An output
filter's ``content_blocked`` keeps its code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from streamwarden.core.dialects import (
    NOTHING,
    Dialect,
    Framing,
    Observation,
    detect,
    sniff,
    stream_framing,
)
from streamwarden.core.dialects.base import DecodedJSON, read_as_text
from streamwarden.core.filters import (
    FilterRule,
    FilterSet,
    Holdback,
    Released,
    apply_cuts,
)
from streamwarden.core.journal import Journal, strip_ids
from streamwarden.core.meter import EndState, GapObserver, StreamMeter
from streamwarden.core.refusals import refusal_body
from streamwarden.core.sse import Event, EventTooLarge, Frame, LineFramer, SSEFramer, with_data
from streamwarden.core.toolcalls import (
    DEPTH,
    INVALID,
    LISTED,
    TOO_LARGE,
    ToolCall,
    ToolCalls,
    starts_calls,
)
from streamwarden.core.usage import HabitWatch, TakeBack, UsageRole, without_usage_null

__all__ = ["KEEPALIVE", "ErrorCode", "Limits", "Relay", "refusal_body"]

#: The comment frame written while the upstream is quiet. Only ever written
#: between two whole events, so it can never split one.
KEEPALIVE = b": keep-alive\n\n"


class ErrorCode(StrEnum):
    """Machine-readable codes of synthesized error events."""

    STREAM_TRUNCATED = "stream_truncated"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    DURATION_EXCEEDED = "duration_exceeded"
    EVENT_TOO_LARGE = "event_too_large"
    SHUTTING_DOWN = "shutting_down"
    CONTENT_BLOCKED = "content_blocked"
    # A tool call's arguments: cut, closed broken, over max_tool_arguments_bytes.
    TOOL_CALL_TRUNCATED = "tool_call_truncated"
    TOOL_CALL_INVALID = "tool_call_invalid"
    TOOL_CALL_TOO_LARGE = "tool_call_too_large"
    # Answers to a resume (no stream is relayed: see streamwarden.features.resume.model).
    RESUME_EXPIRED = "resume_expired"
    RESUME_GAP = "resume_gap"
    RESUME_UNAVAILABLE = "resume_unavailable"


# What each code means for the stream's end state, and what the client is told.
_ENDINGS: dict[ErrorCode, tuple[EndState, str]] = {
    ErrorCode.STREAM_TRUNCATED: (
        EndState.UPSTREAM_TRUNCATED,
        "the upstream ended the stream without {terminal}",
    ),
    ErrorCode.UPSTREAM_ERROR: (EndState.UPSTREAM_ERROR, "the upstream broke off the stream"),
    ErrorCode.UPSTREAM_TIMEOUT: (
        EndState.UPSTREAM_TIMEOUT,
        "the upstream sent nothing for {idle:g}s",
    ),
    ErrorCode.DURATION_EXCEEDED: (
        EndState.LIMIT_EXCEEDED,
        "the stream reached its maximum duration of {duration:g}s",
    ),
    ErrorCode.EVENT_TOO_LARGE: (
        EndState.LIMIT_EXCEEDED,
        "an upstream event exceeded the limit of {event_bytes} bytes",
    ),
    ErrorCode.SHUTTING_DOWN: (EndState.SHUTDOWN, "the proxy is shutting down"),
    ErrorCode.CONTENT_BLOCKED: (EndState.BLOCKED, "an output filter blocked the answer"),
    # (Their reasons name the call: see _tool_failure and _inside_call.)
    ErrorCode.TOOL_CALL_TRUNCATED: (EndState.UPSTREAM_TRUNCATED, "a tool call was cut"),
    ErrorCode.TOOL_CALL_INVALID: (EndState.UPSTREAM_ERROR, "a tool call was closed broken"),
    ErrorCode.TOOL_CALL_TOO_LARGE: (EndState.LIMIT_EXCEEDED, "a tool call was too large"),
}
# The codes a call still open turns into tool_call_truncated: every ending but
# a filter's block (which says more) and the tool calls' own.
_KEEP_CODE = frozenset(
    {
        ErrorCode.CONTENT_BLOCKED,
        ErrorCode.TOOL_CALL_TRUNCATED,
        ErrorCode.TOOL_CALL_INVALID,
        ErrorCode.TOOL_CALL_TOO_LARGE,
    }
)
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
# A truncation inside a block or line says so: for a dialect with no terminal
# event that is the whole story, for the others it comes before the terminal.
_TRUNCATED_INSIDE = "the upstream ended the stream inside an unfinished {unit}"
_BEFORE_TERMINAL = ", before {terminal}"
_NESTED_TOO_DEEP = "an upstream event nested deeper than the proxy reads"


@dataclass(frozen=True, slots=True)
class Limits:
    """The per-stream limits. A duration of 0 disables its timer."""

    #: Seconds without a write to the client before a keep-alive comment.
    keepalive_interval: float
    #: Seconds without any upstream byte, mid-stream, before giving up.
    upstream_idle_timeout: float
    #: Seconds from the request to the forced end of the stream.
    max_stream_duration: float
    #: Largest raw size of one event block (or line) in bytes.
    max_event_bytes: int
    #: Most bytes of tool-call arguments held at once (see :mod:`streamwarden.core.toolcalls`).
    max_tool_arguments_bytes: int = 1024 * 1024
    #: Most levels of objects and arrays in one tool call's arguments.
    max_tool_arguments_depth: int = DEPTH


class Relay:
    """One streamed response on its way from the upstream to the client."""

    __slots__ = (
        "_client_gone",
        "_detach_deadline",
        "_dialect",
        "_drain_deadline",
        "_draining_for_meter",
        "_filters",
        "_framer",
        "_framing",
        "_holdback",
        "_last_upstream",
        "_last_write",
        "_limits",
        "_provisional",
        "_take_usage_chunk",
        "_take_usage_null",
        "_terminal_seen",
        "_tools",
        "_unwritable",
        "_usage_watch",
        "journal",
        "meter",
    )

    def __init__(
        self,
        limits: Limits,
        *,
        started_at: float,
        now: float,
        path: str,
        content_type: str | None,
        headers: Mapping[str, str],
        dialect: str = "auto",
        gap_observer: GapObserver | None = None,
        framing: Framing | None = None,
        journal: Journal | None = None,
        usage: UsageRole = None,
        filters: FilterSet | None = None,
    ) -> None:
        self._limits = limits
        # Usage injection: what to take back of it, or the habit to watch.
        self._take_usage_chunk, self._take_usage_null, self._usage_watch = _usage_parts(usage)
        #: On a resumable route: numbers and stores every event (ids stamped).
        self.journal = journal
        # The faces pass the framing their stream plan decided (it knows the
        # configured extra media types); on its own the relay works it out.
        self._framing: Framing = framing or stream_framing(content_type, headers) or "sse"
        detection = detect(
            dialect, path=path, content_type=content_type, headers=headers, framing=self._framing
        )
        self._dialect: Dialect = detection.dialect
        self._provisional = detection.provisional
        self._framer: SSEFramer | LineFramer = (
            SSEFramer(limits.max_event_bytes)
            if self._framing == "sse"
            else LineFramer(limits.max_event_bytes)
        )
        self.meter = StreamMeter(started_at, gap_observer)
        # The response headers went out just now: keep-alives count from here.
        self._last_write = now
        self._last_upstream = now
        self._terminal_seen = False
        self._client_gone = False
        self._drain_deadline: float | None = None
        # on_client_gone: drain: the client left, the upstream is read on.
        self._draining_for_meter = False
        # on_client_gone: detach: the client left, the stream runs on into
        # its journal until this time unless someone resumes it.
        self._detach_deadline: float | None = None
        #: The route's output filters, and this stream's matcher (None: no filters).
        self._filters = filters
        self._holdback: Holdback[_Waiting] | None = None
        #: The stream's tool calls, from the first step of one (None: none yet).
        self._tools: ToolCalls | None = None
        #: An event the filters changed could not be written again (hostile
        #: data: a lone surrogate, nesting past the parser): fail closed.
        self._unwritable = False
        if filters is not None:
            self._holdback = filters.holdback(limits.max_event_bytes)
            self.meter.filters = self._holdback.stats

    # -- state ---------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The stream has ended: finish the client response, close the upstream."""
        return self.meter.end_state is not None

    @property
    def end_state(self) -> EndState | None:
        return self.meter.end_state

    @property
    def dialect(self) -> str:
        return self._dialect.name

    @property
    def framing(self) -> Framing:
        return self._framing

    def open_tool_calls(self) -> list[dict[str, object]]:
        """The first :data:`~streamwarden.core.toolcalls.LISTED` tool calls open now (id,
        name, bytes of arguments so far): for ``/streams``, beside :attr:`open_tool_call_count`."""
        tools = self._tools
        if tools is None:
            return []
        return [
            {"id": c.call_id, "name": c.name, "arguments_bytes": c.size}
            for c in tools.first_open(LISTED)
        ]

    @property
    def open_tool_call_count(self) -> int:
        """How many tool calls are open now (a stream may hold thousands: few are listed)."""
        tools = self._tools
        return 0 if tools is None else tools.open_count

    @property
    def last_write(self) -> float:
        """When bytes (an event or a keep-alive) last went to the client."""
        return self._last_write

    @property
    def client_present(self) -> bool:
        """The client has not left (nor been cut as too slow)."""
        return not self._client_gone

    @property
    def deadline(self) -> float | None:
        """The time by which ``poll`` must be called next, or ``None`` if no timer runs.

        Feeding and polling only ever move it later (or to ``None`` once the
        stream is done), never sooner: the faces rely on this to keep one
        timer per stream, which may fire early but never late.
        """
        if self.done:
            return None
        limits = self._limits
        times: list[float] = []
        if limits.max_stream_duration > 0:
            times.append(self.meter.started_at + limits.max_stream_duration)
        if limits.upstream_idle_timeout > 0:
            times.append(self._last_upstream + limits.upstream_idle_timeout)
        if limits.keepalive_interval > 0 and self._framing == "sse" and not self._client_gone:
            times.append(self._last_write + limits.keepalive_interval)
        if self._drain_deadline is not None:
            times.append(self._drain_deadline)
        if self._detach_deadline is not None:
            times.append(self._detach_deadline)
        return min(times) if times else None

    # -- inputs --------------------------------------------------------------

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Upstream bytes arrived; return the whole frames they completed."""
        if self.done and not self._client_gone:
            return b""
        self.meter.bytes_in += len(chunk)
        self._last_upstream = now
        try:
            frames = self._framer.feed(chunk)
        except EventTooLarge as exc:
            out = self._forward(exc.frames, now)
            return out + self._fail(ErrorCode.EVENT_TOO_LARGE, now)
        if not frames:
            return b""
        try:
            return self._forward(frames, now)
        except RecursionError:
            # Nesting that a parser or a writer on the way could not follow.
            # Each known one is measured first (max_tool_arguments_depth):
            # this is the net under them, so that no input ends a stream
            # without its error event.
            return self._fail(ErrorCode.EVENT_TOO_LARGE, now, _NESTED_TOO_DEEP)

    def upstream_eof(self, now: float) -> bytes:
        """The upstream ended its response cleanly."""
        if self.done:
            return b""
        # A block or line cut before its terminator is a truncation in any dialect.
        partial = self._framer.pending_bytes > 0
        # What waited on the filters is decided on the text as it stands, and goes first.
        if self._holdback is None:
            out = self._upstream_ended(partial, now)
        else:
            flushed = self._flush_filters(now)
            out = flushed if self.done else flushed + self._upstream_ended(partial, now)
        # The partial block or line is dropped, never forwarded (only after the
        # ending was decided: a tool call cut inside it is named from its bytes).
        self._framer.close()
        return out

    def _upstream_ended(self, partial: bool, now: float) -> bytes:
        meter = self.meter
        dialect = self._dialect
        if meter.upstream_reported_error:
            meter.end(EndState.UPSTREAM_ERROR, now)
        elif self._draining_for_meter:
            meter.end(EndState.DRAINED, now)
        elif self._terminal_seen or not (dialect.expects_terminal or partial):
            meter.end(EndState.COMPLETED, now)
        elif partial:
            reason = _TRUNCATED_INSIDE.format(unit="event" if self._framing == "sse" else "line")
            if dialect.expects_terminal:
                reason += _BEFORE_TERMINAL.format(terminal=dialect.terminal_event)
            return self._fail(ErrorCode.STREAM_TRUNCATED, now, reason)
        else:
            return self._fail(ErrorCode.STREAM_TRUNCATED, now)
        return b""

    def upstream_failed(self, now: float) -> bytes:
        """The upstream connection broke (reset, bad chunked encoding, read error)."""
        if self.done:
            return b""
        return self._end_or_fail(ErrorCode.UPSTREAM_ERROR, now)

    def upstream_refused(self, now: float, code: ErrorCode, reason: str) -> bytes:
        """The upstream never delivered a stream after the client's response began.

        Only with early headers: the client already has ``200`` and
        keep-alives when the upstream fails to connect, times out, or answers
        with an error status or a body that is not a stream.
        """
        if self.done:
            return b""
        return self._fail(code, now, reason)

    def client_gone(
        self, now: float, *, drain: bool = False, detach_until: float | None = None
    ) -> None:
        """The client disconnected. Later upstream content counts as zombie tokens.

        With ``drain`` (``on_client_gone: drain``) the stream does not end
        here: the face keeps reading the upstream, nothing more is written,
        and a clean end of the upstream is ``drained``, with its final usage
        metered. Failures and limits still end it as they would.

        With ``detach_until`` (``on_client_gone: detach``, on a stream with
        a journal) the stream runs on into its journal, for a client that
        resumes, and ends as it would have with its client there; if it is
        still running at ``detach_until`` and nobody resumed it
        (:meth:`keep_detached`), it ends ``detached_expired``.
        """
        self._client_gone = True
        if self.done:
            return
        if self._terminal_seen:
            self.meter.end(EndState.COMPLETED, now)
        elif detach_until is not None and self.journal is not None:
            if self._detach_deadline is None:
                self._detach_deadline = detach_until
        elif drain:
            self._draining_for_meter = True
        else:
            self.meter.end(EndState.CLIENT_CANCELLED, now)

    @property
    def draining(self) -> bool:
        """The client left and the upstream is read on (``drain`` or ``detach``)."""
        return (self._draining_for_meter or self._detach_deadline is not None) and not self.done

    @property
    def detached(self) -> bool:
        """The client left and the stream runs on for a resume (``detach``)."""
        return self._detach_deadline is not None and not self.done

    def keep_detached(self, until: float) -> None:
        """Someone resumed (or holds a lease on) this stream: run on until ``until`` at least."""
        if self._detach_deadline is not None and until > self._detach_deadline:
            self._detach_deadline = until

    def detach_due(self, now: float) -> bool:
        """A detached stream's window ran out: ask for a resume's hold before ``poll``."""
        return self._detach_deadline is not None and not self.done and now >= self._detach_deadline

    def stop(self, now: float) -> None:
        """An explicit stop (``DELETE``) by the stream's owner: end it now."""
        if not self.done:
            self._client_gone = True
            self.meter.end(EndState.CLIENT_CANCELLED, now)

    def seal_journal(self) -> None:
        """End a journaled stream's record with an error event if its end wrote none.

        A stream can end without its terminal event and without a synthesized
        error (nobody resumed it in time, its owner stopped it, the face cut
        it): a client that resumes it must be told so, never handed the cut
        answer as if it were whole. Nothing goes to this stream's own client.
        """
        journal = self.journal
        state = self.meter.end_state
        if (
            journal is None
            or self._framing != "sse"
            or self._terminal_seen
            or self.meter.error_code is not None
            or state in (None, EndState.COMPLETED, EndState.DRAINED)
        ):
            return
        code, reason = _SEALS.get(state, _SEAL_OTHER)
        journal.record(self._dialect.error_event(code, f"streamwarden: {reason} ({code})"))

    def resumed(self) -> None:
        """A resumed client received what this stream's own client missed: no zombies."""
        self.meter.resumed()

    def client_too_slow(self, now: float) -> None:
        """The client did not take our writes within ``client_write_timeout``."""
        self._client_gone = True
        self.meter.end(EndState.CLIENT_TOO_SLOW, now)

    def drain_by(self, deadline: float) -> None:
        """The process is draining: the stream may run on until ``deadline``, no longer.

        ``poll`` at or after it ends the stream with ``shutting_down`` (unless
        its answer was already whole). The one deadline that can move
        sooner: the face must wake its timer after calling this.
        """
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline

    def shutdown(self, now: float) -> bytes:
        """The process is draining and its grace period ran out."""
        if self.done:
            return b""
        return self._end_or_fail(ErrorCode.SHUTTING_DOWN, now)

    def poll(self, now: float) -> bytes:
        """Run the timers: drain, stream duration, upstream idle timeout, keep-alive."""
        if self.done:
            return b""
        if self._drain_deadline is not None and now >= self._drain_deadline:
            return self._end_or_fail(ErrorCode.SHUTTING_DOWN, now)
        if self._detach_deadline is not None and now >= self._detach_deadline:
            self.meter.end(EndState.DETACHED_EXPIRED, now)
            return b""
        limits = self._limits
        if limits.max_stream_duration > 0 and (
            now >= self.meter.started_at + limits.max_stream_duration
        ):
            return self._end_or_fail(ErrorCode.DURATION_EXCEEDED, now)
        if limits.upstream_idle_timeout > 0 and (
            now >= self._last_upstream + limits.upstream_idle_timeout
        ):
            return self._end_or_fail(ErrorCode.UPSTREAM_TIMEOUT, now)
        if (
            limits.keepalive_interval > 0
            and self._framing == "sse"
            and not self._client_gone
            and now >= self._last_write + limits.keepalive_interval
        ):
            self._last_write = now
            self.meter.keepalives += 1
            self.meter.bytes_out += len(KEEPALIVE)
            return KEEPALIVE
        return b""

    # -- internals -----------------------------------------------------------

    def _forward(self, frames: list[Frame], now: float) -> bytes:
        if not frames:
            return b""
        if self._holdback is not None:
            return self._forward_filtered(frames, now)
        meter = self.meter
        delivered = not self._client_gone
        events = 0
        hidden: list[Frame] | None = None
        broken: ToolCall | None = None
        for position, frame in enumerate(frames):
            event = frame.event
            if event is None:
                continue
            events += 1
            seen = self._inspect(frame, event, now)
            if seen is NOTHING:
                continue
            if seen.calls is not None or seen.terminal:
                broken = self._follow_calls(seen)
                if broken is not None:  # it and what follows it never go out
                    frames = frames[:position]
                    break
            if seen.usage_only and self._take_usage_chunk:
                hidden = [frame] if hidden is None else [*hidden, frame]
            if seen.text:
                meter.content(seen.text, now, delivered=delivered)
            if seen.output_tokens is not None:
                meter.usage_tokens = seen.output_tokens
            if seen.input_tokens is not None:
                meter.input_tokens = seen.input_tokens
            if seen.terminal:
                self._terminal_seen = True
                meter.usage_final = True
            if seen.error:
                meter.upstream_reported_error = True
        meter.events_in += events
        if broken is not None:
            events -= 1
        if hidden is not None or self._take_usage_null:
            frames = _as_sent_without_injection(frames, hidden, self._take_usage_null)
            if hidden:
                events -= len(hidden)
        out = self._emit(frames, events, now) if frames else b""
        return out if broken is None else out + self._tool_failure(broken, now)

    def _inspect(self, frame: Frame, event: Event, now: float) -> Observation:
        """What the dialect reads in an event, after the first one settled which dialect it is.

        A watch of the upstream's usage habit sees every event until it has
        learned what it watches for.
        """
        if self._provisional:
            self._provisional = False
            self._dialect = sniff(event, self._dialect)
        seen = self._dialect.inspect(event)
        watch = self._usage_watch
        if watch is not None:
            watch.see(frame, seen, now)
            if watch.settled:
                self._usage_watch = None
        return seen

    def _emit(self, frames: list[Frame], events: int, now: float) -> bytes:
        """Write whole frames (``events`` of them carry an event): journal, count, return."""
        meter = self.meter
        delivered = not self._client_gone
        journal = self.journal
        if journal is not None and not self.done:
            if len(frames) == 1:
                only = frames[0]
                out = strip_ids(only.raw) if only.event is None else journal.record(only.raw)
            else:
                out = b"".join(
                    [strip_ids(f.raw) if f.event is None else journal.record(f.raw) for f in frames]
                )
            if not delivered:
                return b""
        elif not delivered:
            return b""
        else:
            out = frames[0].raw if len(frames) == 1 else b"".join(f.raw for f in frames)
        meter.events_out += events
        meter.bytes_out += len(out)
        self._last_write = now
        return out

    def _forward_filtered(self, frames: list[Frame], now: float) -> bytes:
        """As :meth:`_forward`, through the output filters' hold-back."""
        holdback = self._holdback
        assert holdback is not None and self._filters is not None
        meter = self.meter
        take_chunk = self._take_usage_chunk
        take_null = self._take_usage_null
        out: list[Frame] = []
        events = 0  # of the frames in out
        arrived = 0
        blocked_by: FilterRule | None = None  # a block match in a whole text
        broken: ToolCall | None = None
        for frame in frames:
            event = frame.event
            if event is None:  # a comment or a stray line: it keeps its place
                if holdback.holding:
                    leaving = holdback.push((frame, None, ""), "", len(frame.raw), now)
                    events += self._take(leaving, out, now)
                else:
                    out.append(frame)
                continue
            arrived += 1
            seen = self._inspect(frame, event, now)
            if seen.calls is not None or seen.terminal:
                broken = self._follow_calls(seen)
                if broken is not None:  # it and what follows it never go out
                    break
            if seen is not NOTHING and self._usage_read(seen, take_chunk):
                continue  # the client never asked for it: never held, never sent
            if take_null:
                frame, event = _frame_without_usage_null(frame, event)
            screened = self._screened(frame, event, seen)
            if not isinstance(screened, Frame):
                blocked_by = screened  # None: it could not be written again
                break
            frame = screened
            event = screened.event or event
            terminal = seen.terminal  # NOTHING reads as no text, no end, no error
            if terminal:
                self._terminal_seen = meter.usage_final = True
            if seen.error:
                meter.upstream_reported_error = True
            events += self._hold(frame, event, seen, out, now)
            if terminal:  # no more text comes: what waits is decided now
                events += self._take(holdback.close(now), out, now)
            if holdback.blocked is not None or holdback.overflow or self._unwritable:
                break
        meter.events_in += arrived
        written = self._emit(out, events, now) if out else b""
        if broken is not None:
            return written + self._tool_failure(broken, now)
        if blocked_by is not None:
            return written + self._block(now, blocked_by)
        if holdback.blocked is not None or holdback.overflow or self._unwritable:
            return written + self._block(now)
        return written

    def _usage_read(self, seen: Observation, take_chunk: bool) -> bool:
        """Meter an event's usage; whether it is the usage chunk to take back."""
        meter = self.meter
        if seen.output_tokens is not None:
            meter.usage_tokens = seen.output_tokens
        if seen.input_tokens is not None:
            meter.input_tokens = seen.input_tokens
        return seen.usage_only and take_chunk

    def _follow_calls(self, seen: Observation) -> ToolCall | None:
        """What an event says of tool calls (a terminal closes them all); the call it broke."""
        tools = self._tools
        steps = seen.calls
        if tools is None:
            if steps is None or not starts_calls(steps):
                return None  # a text block's stop, a choice's finish: no call yet
            tools = self._new_tools()
        if steps is not None:
            broken = tools.follow(steps)
            if broken is not None:
                return broken
        return tools.finish_all() if seen.terminal else None

    def _new_tools(self) -> ToolCalls:
        """The stream's tool calls, from its first."""
        limits = self._limits
        tools = ToolCalls(limits.max_tool_arguments_bytes, limits.max_tool_arguments_depth)
        self._tools = self.meter.tool_calls = tools
        return tools

    def _tool_failure(self, call: ToolCall, now: float) -> bytes:
        """End the stream in place of the event that broke ``call``: invalid, or too large."""
        if call.end_state == TOO_LARGE and call.nested:
            depth = self._limits.max_tool_arguments_depth
            reason = (
                f"the arguments of {call.describe()} nest deeper than {depth} levels"
                " (max_tool_arguments_depth)"
            )
            return self._fail(ErrorCode.TOOL_CALL_TOO_LARGE, now, reason)
        if call.end_state == TOO_LARGE:
            limit = self._limits.max_tool_arguments_bytes
            reason = (
                f"the arguments held for the stream's open tool calls exceeded {limit} bytes"
                f" (max_tool_arguments_bytes) at {call.describe()}"
            )
            return self._fail(ErrorCode.TOOL_CALL_TOO_LARGE, now, reason)
        assert call.end_state == INVALID
        reason = (
            f"the upstream closed {call.describe()} with arguments that are not a whole JSON"
            f" object ({call.size} bytes)"
        )
        return self._fail(ErrorCode.TOOL_CALL_INVALID, now, reason)

    def _inside_call(self) -> str | None:
        """The tool calls a cut now breaks, as a message names them, if any."""
        tools = self._tools
        calls = tools.cut_calls() if tools is not None else []
        framer = self._framer
        if not calls and self._dialect.calls_arrive_whole and framer.pending_bytes:
            cut = self._dialect.call_in_cut(framer.held())
            if cut is not None:
                calls = [(tools if tools is not None else self._new_tools()).cut_whole(*cut)]
        if not calls:
            return None
        if len(calls) == 1:
            return f"inside {calls[0].describe()}, {_received(calls[0])}"
        # Each named (id, name, bytes), up to as many as a record lists.
        named = "; ".join(f"{call.describe()}, {_received(call)}" for call in calls[:LISTED])
        more = f"; and {len(calls) - LISTED} more" if len(calls) > LISTED else ""
        return f"inside {len(calls)} tool calls: {named}{more}"

    def _screened(self, frame: Frame, event: Event, seen: Observation) -> Frame | FilterRule | None:
        """The event as it goes into the hold-back, or the rule of a ``block`` match in it.

        Before the hold-back looks at the stream's text, what it would not
        see is filtered here: a summary's whole texts, each on its own, and
        text the dialect does not read. ``None``: the event changed and
        could not be written again (hostile data): the stream fails closed.
        """
        filters = self._filters
        assert filters is not None
        dialect = self._dialect
        if dialect.repeats_text(event):  # a summary with whole texts: filtered as wholes
            try:
                whole = self._whole_texts_filtered(frame, event)
            except _UNWRITABLE:
                self._unwritable = True
                return None
            if isinstance(whole, FilterRule):
                return whole
            frame = whole
            event = whole.event or event
        if (
            _reads_no_text(seen)
            and event.data
            and (filters.tool_arguments or not dialect.carries_tool_arguments(event))
        ):
            # Text the dialect does not read (a field it does not know, an
            # event type it does not expect, data it cannot parse) is still
            # text a client may show, as its JSON parser decodes it: a match
            # in it fails closed.
            unread = filters.whole(event.data)
            if unread.matched is None and "\\" in event.data:
                decoded = read_as_text(event.data)
                if isinstance(decoded, DecodedJSON):
                    unread = filters.whole(decoded[0])
            if unread.matched is not None:
                return unread.blocked or unread.matched
        return frame

    def _hold(
        self, frame: Frame, event: Event, seen: Observation, out: list[Frame], now: float
    ) -> int:
        """Put an event in the hold-back; append what leaves it to ``out``, return how many."""
        holdback = self._holdback
        assert holdback is not None and self._filters is not None
        dialect = self._dialect
        text = seen.text
        size = len(frame.raw)
        if seen.tools or dialect.reads_own_texts(event):
            # Tool-call arguments (each call's a text of its own), or data read
            # decoded: the filters read this event's texts themselves.
            keyed = dialect.filter_texts(event, self._filters.tool_arguments)
            parts = [part for _, part in keyed]
            released = holdback.push_texts((frame, parts, text), keyed, size, now)
        else:  # the dialect's own text is what they read, all of the main text
            released = holdback.push((frame, None, text), text, size, now)
        if released is not None:
            return self._take(released, out, now)
        # Nothing waits and nothing matched: out as it came.
        out.append(frame)
        if text:
            self.meter.content(text, now, delivered=not self._client_gone)
        return 1

    def _whole_texts_filtered(self, frame: Frame, event: Event) -> Frame | FilterRule:
        """A summary event with each whole text it repeats filtered on its own.

        The frame as it came when no filter matches, the rewritten frame when
        one redacts, or the rule of a ``block`` match. A match here repeats
        one the deltas already had (counted there), except a block: the
        deltas never carried that text, or the stream would have ended.
        """
        filters = self._filters
        assert filters is not None
        root, places = self._dialect.whole_texts(event, filters.tool_arguments)
        changed = False
        for container, key in places:
            text = container[key]
            if not text:
                continue
            decided = filters.whole(text)
            if decided.blocked is not None:
                return decided.blocked
            if decided.cuts:
                container[key] = apply_cuts([text], decided.cuts)[0]
                changed = True
        if not changed:
            return frame
        data = self._dialect.dump_data(event, root)
        raw = with_data(frame.raw, data, lines=self._framing == "lines")
        return Frame(raw, Event(event.event, data, event.id))

    def _take(self, released: list[Released[_Waiting]] | None, out: list[Frame], now: float) -> int:
        """Append the events the hold-back let go to ``out``, redacted; return how many."""
        if not released:
            return 0
        meter = self.meter
        delivered = not self._client_gone
        events = 0
        for leaving in released:
            frame, parts, text = leaving.item
            event = frame.event
            if event is not None:
                if leaving.cuts:
                    try:
                        frame = self._redacted(frame, event, parts, leaving.cuts)
                    except _UNWRITABLE:
                        self._unwritable = True  # neither this event nor any after it
                        break
                events += 1
            if text:
                meter.content(text, now, delivered=delivered)
            out.append(frame)
        return events

    def _redacted(
        self,
        frame: Frame,
        event: Event,
        parts: list[str] | None,
        cuts: tuple[tuple[int, int, str], ...],
    ) -> Frame:
        assert self._filters is not None
        tools = self._filters.tool_arguments
        if parts is None:  # the dialect's text was the filtered text: its parts, read again
            parts = self._dialect.filter_text(event, tools)
        data = self._dialect.rewrite_text(event, tools, apply_cuts(parts, cuts))
        return Frame(with_data(frame.raw, data, lines=self._framing == "lines"), event)

    def _flush_filters(self, now: float) -> bytes:
        """The text ended: release what waits (or block, if its end completes a match)."""
        holdback = self._holdback
        if holdback is None or not holdback.holding:
            return b""
        out: list[Frame] = []
        events = self._take(holdback.close(now), out, now)
        written = self._emit(out, events, now) if out else b""
        if holdback.blocked is not None or self._unwritable:
            return written + self._block(now)
        return written

    def _block(self, now: float, rule: FilterRule | None = None) -> bytes:
        """End the stream ``content_blocked``: a block match (``rule``: in a whole text)."""
        holdback = self._holdback
        assert holdback is not None
        if rule is not None:
            matches = holdback.stats.matches
            key = (rule.name, rule.action)
            matches[key] = matches.get(key, 0) + 1
        else:
            rule = holdback.blocked
        if rule is not None:
            reason = f"an output filter ({rule.name}) blocked the answer"
        elif self._unwritable:
            reason = "an event the output filters changed could not be written again"
        else:  # overflow: fail closed rather than let a split match through
            reason = (
                "the events held back by the output filters, waiting for a possible match,"
                f" exceeded {self._limits.max_event_bytes} bytes"
            )
        return self._fail(ErrorCode.CONTENT_BLOCKED, now, reason)

    def _end_or_fail(self, code: ErrorCode, now: float) -> bytes:
        # An answer whose terminal event was delivered is complete, whatever
        # happens to the connection afterwards.
        if self._terminal_seen and not self.meter.upstream_reported_error:
            self.meter.end(EndState.COMPLETED, now)
            return b""
        return self._fail(code, now)

    def _fail(self, code: ErrorCode, now: float, reason: str | None = None) -> bytes:
        if self.done:
            return b""
        if self._holdback is not None and code is not ErrorCode.CONTENT_BLOCKED:
            # Whole events that waited on the filters go out before the error.
            flushed = self._flush_filters(now)
            if flushed or self.done:
                return flushed if self.done else flushed + self._fail(code, now, reason)
        state, template = _ENDINGS[code]
        limits = self._limits
        reason = reason or template.format(
            terminal=self._dialect.terminal_event,
            idle=limits.upstream_idle_timeout,
            duration=limits.max_stream_duration,
            event_bytes=limits.max_event_bytes,
        )
        if code not in _KEEP_CODE:
            inside = self._inside_call()
            if inside is not None:  # the code says what it cut; the end state, why
                code = ErrorCode.TOOL_CALL_TRUNCATED
                reason = f"{reason}, {inside}"
        self.meter.end(state, now, code)
        error = self._dialect.error_event(code, f"streamwarden: {reason} ({code})")
        if self.journal is not None and self._framing == "sse":
            # A resumed client must end the way this stream ended.
            error = self.journal.record(error)
        if self._client_gone:
            return b""
        self.meter.bytes_out += len(error)
        return error


def _received(call: ToolCall) -> str:
    return f"with {call.size} bytes of its arguments received"


def _reads_no_text(seen: Observation) -> bool:
    """Whether the dialect read nothing of an event's text (the filters search it whole).

    An event it reads only tool-call steps in (a block's start or stop, a
    choice's finish) counts as one it reads nothing in, as it did before
    the dialects followed tool calls.
    """
    if seen is NOTHING:
        return True
    return (
        seen.calls is not None
        and not seen.text
        and seen.output_tokens is None
        and seen.input_tokens is None
        and not (seen.terminal or seen.error or seen.usage_only)
    )


#: An event in the filters' hold-back: its frame, the text parts the filters
#: read (``None``: the dialect's own text, read again only to redact), and the
#: text the meter counts.
_Waiting = tuple[Frame, list[str] | None, str]


#: What re-serialising hostile data may raise (a lone surrogate, nesting too deep).
_UNWRITABLE = (ValueError, UnicodeError, RecursionError)


def _usage_parts(usage: UsageRole) -> tuple[bool, bool, HabitWatch | None]:
    """The relay's part in usage injection: (take back the chunk, take back nulls, a watch).

    The face asked the upstream for usage the client did not ask for: take
    back what that added to the stream, and only that. Or the request went
    unchanged to learn the upstream's habit: watch what it sends unasked.
    """
    if isinstance(usage, TakeBack):
        return usage.chunk, usage.nulls, None
    return False, False, usage


def _without_usage_null(event: Event) -> Event:
    """The event whose data lost the ``"usage": null`` its raw bytes lost."""
    data = without_usage_null(event.data.encode()).decode()
    return Event(event.event, data, event.id)


def _frame_without_usage_null(frame: Frame, event: Event) -> tuple[Frame, Event]:
    """An event's frame without the ``"usage": null`` the client never asked for.

    The event too: a redaction re-serialises from its data, which must not
    bring back the field.
    """
    raw = without_usage_null(frame.raw)
    if raw is frame.raw:
        return frame, event
    event = _without_usage_null(event)
    return Frame(raw, event), event


def _as_sent_without_injection(
    frames: list[Frame], hidden: list[Frame] | None, nulls: bool
) -> list[Frame]:
    """The frames a client that never asked for usage would have received."""
    kept: list[Frame] = []
    for frame in frames:
        if hidden is not None and any(frame is h for h in hidden):
            continue
        if not nulls:
            kept.append(frame)
            continue
        raw = without_usage_null(frame.raw)
        kept.append(frame if raw is frame.raw else Frame(raw, frame.event))
    return kept
