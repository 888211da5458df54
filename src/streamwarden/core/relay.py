"""The per-stream state machine that both faces drive, with no I/O.

A face (the aiohttp sidecar, the ASGI middleware) creates one
:class:`Relay` per streamed response (through the pipeline) and moves
bytes and time through it:

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

Every rule about when a stream ends lives here (what each ending says is
:mod:`streamwarden.core.endings`): which failures produce an error event,
and that a stream whose terminal event was already delivered is complete
whatever happens afterwards. Tool calls are checked on the way out
(:mod:`streamwarden.core.calls`): they are part of an honest ending.

Every frame takes one path (:meth:`Relay._forward`): the dialect reads it,
the relay keeps its books (usage, terminal, errors, tool calls), and then,
on a stream whose stages gave it transforms (output filters, usage
take-back, the resume journal: its :class:`~streamwarden.core.transform.TransformChain`),
it goes through them in the plan's order before it is written; the meter
counts the text of what leaves them, when it leaves. A plain stream has
none: its frames go out as they came.

Three parts of a stream have modules of their own, which the relay drives:
its timers (:mod:`streamwarden.core.timers`: which one is due, and when
the next one is), its lifecycle (:mod:`streamwarden.core.lifecycle`: the
phase, and what the face does next) and its transforms
(:mod:`streamwarden.core.transform`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from streamwarden.core.calls import CallCheck
from streamwarden.core.dialects import (
    NOTHING,
    Dialect,
    Framing,
    detect,
    sniff,
    stream_framing,
)
from streamwarden.core.endings import (
    BEFORE_TERMINAL,
    ENDINGS,
    KEEP_CODE,
    NESTED_TOO_DEEP,
    TRUNCATED_INSIDE,
    ErrorCode,
)
from streamwarden.core.lifecycle import Input, Lifecycle, Next, Phase
from streamwarden.core.meter import EndState, GapObserver, StreamMeter
from streamwarden.core.refusals import refusal_body
from streamwarden.core.sse import EventTooLarge, Frame, LineFramer, MessageFramer, SSEFramer
from streamwarden.core.timers import ENDING, Timer, Timers
from streamwarden.core.toolcalls import DEPTH, ToolCall
from streamwarden.core.transform import Stop, TransformChain

__all__ = ["KEEPALIVE", "ErrorCode", "Limits", "Relay", "refusal_body"]

#: The comment frame written while the upstream is quiet. Only ever written
#: between two whole events, so it can never split one.
KEEPALIVE = b": keep-alive\n\n"


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

    def say(self, template: str, terminal: str) -> str:
        """An ending's reason (:data:`~streamwarden.core.endings.ENDINGS`), with these limits."""
        return template.format(
            terminal=terminal,
            idle=self.upstream_idle_timeout,
            duration=self.max_stream_duration,
            event_bytes=self.max_event_bytes,
        )


class Relay:
    """One streamed response on its way from the upstream to the client."""

    __slots__ = (
        "_dialect",
        "_framer",
        "_framing",
        "_limits",
        "_provisional",
        "_terminal_seen",
        "calls",
        "chain",
        "lifecycle",
        "meter",
        "timers",
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
    ) -> None:
        self._limits = limits
        # The faces pass the framing their stream plan decided (it knows the
        # configured extra media types); on its own the relay works it out.
        self._framing: Framing = framing or stream_framing(content_type, headers) or "sse"
        detection = detect(
            dialect, path=path, content_type=content_type, headers=headers, framing=self._framing
        )
        self._dialect: Dialect = detection.dialect
        self._provisional = detection.provisional
        self._framer: SSEFramer | LineFramer | MessageFramer = (
            SSEFramer(limits.max_event_bytes)
            if self._framing == "sse"
            else LineFramer(limits.max_event_bytes)
            if self._framing == "lines"
            else MessageFramer(limits.max_event_bytes)  # each feed: one whole message
        )
        self.meter = StreamMeter(started_at, gap_observer)
        #: The stream's tool calls, checked on the way out (``/streams`` lists the open ones).
        self.calls = CallCheck(
            self.meter, limits.max_tool_arguments_bytes, limits.max_tool_arguments_depth
        )
        self.timers = Timers(
            started_at=started_at,
            now=now,
            duration=limits.max_stream_duration,
            idle=limits.upstream_idle_timeout,
            # A comment frame is SSE's alone: other framings get no keep-alive.
            keepalive=limits.keepalive_interval if self._framing == "sse" else 0.0,
        )
        self.lifecycle = Lifecycle(self.meter, self.timers)
        #: The stream's stages' transforms (``None``: a plain stream, whose frames go out bare).
        self.chain: TransformChain | None = None
        self._terminal_seen = False

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
    def rules(self) -> Dialect:
        """The stream's dialect itself (settled at its first event), for its transforms."""
        return self._dialect

    @property
    def framing(self) -> Framing:
        return self._framing

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def terminal_seen(self) -> bool:
        """The upstream's terminal event arrived: the answer is whole."""
        return self._terminal_seen

    @property
    def deadline(self) -> float | None:
        """When ``poll`` must be called next (``None``: no timer runs): see :class:`Timers`."""
        return None if self.done else self.timers.next(self.lifecycle.present)

    # -- inputs --------------------------------------------------------------

    def feed(self, chunk: bytes, now: float) -> bytes:
        """Upstream bytes arrived; return the whole frames they completed."""
        if self.done and self.lifecycle.present:
            return b""
        self.meter.bytes_in += len(chunk)
        self.timers.last_upstream = now
        try:
            frames = self._framer.feed(chunk)
        except EventTooLarge as exc:
            out = self._forward(exc.frames, now) if exc.frames else b""
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
            return self._fail(ErrorCode.EVENT_TOO_LARGE, now, NESTED_TOO_DEEP)

    def upstream_eof(self, now: float) -> bytes:
        """The upstream ended its response cleanly."""
        if self.done:
            return b""
        # A block or line cut before its terminator is a truncation in any dialect.
        partial = self._framer.pending_bytes > 0
        # What waited on the stages is decided on the text as it stands, and goes first.
        out = self._close_chain(self.chain, now) if self.chain is not None else b""
        if not self.done:
            out += self._upstream_ended(partial, now)
        # The partial block or line is dropped, never forwarded (only after the
        # ending was decided: a tool call cut inside it is named from its bytes).
        self._framer.close()
        return out

    def _upstream_ended(self, partial: bool, now: float) -> bytes:
        meter = self.meter
        dialect = self._dialect
        if meter.upstream_reported_error:
            self.lifecycle.end(EndState.UPSTREAM_ERROR, now)
        elif self.lifecycle.phase is Phase.DRAINING:
            self.lifecycle.end(EndState.DRAINED, now)
        elif self._terminal_seen or not (dialect.expects_terminal or partial):
            self.lifecycle.end(EndState.COMPLETED, now)
        elif partial:
            reason = TRUNCATED_INSIDE.format(unit="event" if self._framing == "sse" else "line")
            if dialect.expects_terminal:
                reason += BEFORE_TERMINAL.format(terminal=dialect.terminal_event)
            return self._fail(ErrorCode.STREAM_TRUNCATED, now, reason)
        else:
            return self._fail(ErrorCode.STREAM_TRUNCATED, now)
        return b""

    def upstream_failed(self, now: float) -> bytes:
        """The upstream connection broke (reset, bad chunked encoding, read error)."""
        if self.done:
            return b""
        return self._end_or_fail(ErrorCode.UPSTREAM_ERROR, now)

    def upstream_refused(self, now: float, code: ErrorCode, reason: str | None = None) -> bytes:
        """No stream after an early ``200``, or a message the upstream's transport refused."""
        if self.done:
            return b""
        return self._fail(code, now, reason)

    # -- the lifecycle (streamwarden.core.lifecycle: its table and its moves) ---

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def next(self) -> Next:
        """What the face does next (the lifecycle's answer to the last input)."""
        return self.lifecycle.next

    def client_gone(self, now: float) -> Next | None:
        """The client disconnected: what the face does now (``None``: nothing new)."""
        return self.lifecycle.client_gone(now, self._terminal_seen)

    def held(self, now: float, left: float | None) -> Next | None:
        """The answer to ``ASK_HOLD``: a resumed client holds the stream ``left`` more seconds."""
        return self.lifecycle.held(now, left)

    def stop(self, now: float) -> Next | None:
        """An explicit stop (``DELETE``) by the stream's owner: end it now."""
        return self.lifecycle.stop(now)

    def client_too_slow(self, now: float) -> Next | None:
        """The client did not take our writes within ``client_write_timeout``."""
        return self.lifecycle.too_slow(now)

    def resumed(self) -> None:
        """A resumed client received what this stream's own client missed: no zombies."""
        self.meter.resumed()

    def drain_by(self, deadline: float) -> None:
        """The process is draining: the stream ends by ``deadline`` (``shutting_down``,
        unless its answer was whole). The one deadline that can move sooner: the face
        must wake its timer after calling this."""
        self.timers.drain_by(deadline)

    def shutdown(self, now: float) -> bytes:
        """The process is draining and its grace period ran out."""
        if self.done:
            return b""
        return self._end_or_fail(ErrorCode.SHUTTING_DOWN, now)

    def poll(self, now: float) -> bytes:
        """Run the timers (:class:`Timers`): the first one due acts."""
        if self.done:
            return b""
        due = self.timers.due(now, self.lifecycle.present)
        if due is None or (self.lifecycle.phase is Phase.EXPIRING and due is not Timer.DRAIN):
            return b""  # expiring: the face asks for a hold first
        if due is Timer.WINDOW:
            self.lifecycle.to(Input.WINDOW_OUT, now, Phase.DETACHED)
            return b""
        if due is Timer.KEEPALIVE:
            self.timers.last_write = now
            self.meter.keepalives += 1
            self.meter.bytes_out += len(KEEPALIVE)
            return KEEPALIVE
        return self._end_or_fail(ENDING[due], now)

    # -- internals -----------------------------------------------------------

    def _forward(self, frames: list[Frame], now: float) -> bytes:
        """Whole frames arrived: read each, keep the books, write what goes out.

        The one path of every frame. The meter counts a plain stream's text
        as it is read; through the stream's chain, as it leaves it.
        """
        meter = self.meter
        # After the end (a gone client's zombie tokens) no stage acts any more.
        chain = None if self.done else self.chain
        out: list[Frame] = []
        events = 0  # of the frames in out (through the chain)
        arrived = 0
        broken: ToolCall | None = None
        delivered = self.lifecycle.present
        for position, frame in enumerate(frames):
            event = frame.event
            if event is None:  # a comment or a stray line: it keeps its place
                if chain is not None:
                    events += chain.through([(frame, NOTHING)], now, out, delivered)
                continue
            arrived += 1
            if self._provisional:
                self._provisional = False
                self._dialect = sniff(event, self._dialect)
            seen = self._dialect.inspect(event)
            if seen is not NOTHING:
                if seen.calls is not None or seen.terminal:
                    broken = self.calls.follow(seen)
                    if broken is not None:  # it and what follows it never go out
                        if chain is None:
                            frames = frames[:position]
                        break
                if seen.text and chain is None:
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
            if chain is not None:
                events += chain.through([(frame, seen)], now, out, delivered)
                if chain.stop is not None:
                    break
        meter.events_in += arrived
        if chain is None:
            out = frames
            events = arrived - 1 if broken is not None else arrived
        if broken is not None:
            code, reason = self.calls.failure(broken)
            return self._emit(out, events, now) + self._fail(code, now, reason)
        return self._emit(out, events, now, chain.stop if chain is not None else None)

    def _close_chain(self, chain: TransformChain, now: float) -> bytes:
        """The text ended: what waits in the chain goes out (or a stop ends the stream)."""
        out: list[Frame] = []
        events = chain.close(now, out, self.lifecycle.present)
        return self._emit(out, events, now, chain.stop)

    def _emit(
        self, frames: list[Frame], events: int, now: float, stop: Stop | None = None
    ) -> bytes:
        """Write whole frames (``events`` of them carry an event), then a transform's stop."""
        out = b""
        if frames and self.lifecycle.present:
            out = frames[0].raw if len(frames) == 1 else b"".join([f.raw for f in frames])
            meter = self.meter
            meter.events_out += events
            meter.bytes_out += len(out)
            self.timers.last_write = now
        return out if stop is None else out + self._fail(stop[0], now, stop[1], False)

    def _end_or_fail(self, code: ErrorCode, now: float) -> bytes:
        # An answer whose terminal event was delivered is complete, whatever
        # happens to the connection afterwards.
        if self._terminal_seen and not self.meter.upstream_reported_error:
            self.lifecycle.end(EndState.COMPLETED, now)
            return b""
        return self._fail(code, now)

    def _fail(
        self, code: ErrorCode, now: float, reason: str | None = None, flush: bool = True
    ) -> bytes:
        """End the stream with an error event (``flush``: what waits in the chain goes first)."""
        if self.done:
            return b""
        out = b""
        chain = self.chain
        if flush and chain is not None:
            out = self._close_chain(chain, now)
            if self.done:  # a stop while they let go (a block): its error went out
                return out
        state, template = ENDINGS[code]
        reason = reason or self._limits.say(template, self._dialect.terminal_event)
        if code not in KEEP_CODE:
            framer = self._framer
            held = framer.held() if framer.pending_bytes else None
            inside = self.calls.inside(self._dialect, held)
            if inside is not None:  # the code says what it cut; the end state, why
                code = ErrorCode.TOOL_CALL_TRUNCATED
                reason = f"{reason}, {inside}"
        # A format whose clients skip an error event also has its body broken.
        self.lifecycle.end(state, now, code, not self._dialect.error_event_raises)
        # A journal in the chain records it for a resumed client.
        error = self._dialect.error_event(code, f"streamwarden: {reason} ({code})")
        if chain is not None:
            error = chain.ending(error)
        if not self.lifecycle.present:
            return out
        self.meter.bytes_out += len(error)
        return out + error
