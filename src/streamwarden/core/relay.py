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
on a stream whose stages gave it :class:`~streamwarden.core.transform.EventTransform`
objects (output filters, usage take-back, the resume journal), it goes
through them in the plan's order before it is written; the meter counts
the text of what leaves them, when it leaves. A plain stream has none:
its frames go out as they came.
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
from streamwarden.core.lifecycle import GONE_INPUT, NEXT, Gone, Input, Next, Phase, step
from streamwarden.core.meter import EndState, GapObserver, StreamMeter
from streamwarden.core.refusals import refusal_body
from streamwarden.core.sse import EventTooLarge, Frame, LineFramer, SSEFramer
from streamwarden.core.toolcalls import DEPTH, ToolCall
from streamwarden.core.transform import EventTransform, Passing, Stop

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


class Relay:
    """One streamed response on its way from the upstream to the client."""

    __slots__ = (
        "_calls",
        "_client_gone",
        "_detach_deadline",
        "_dialect",
        "_drain_deadline",
        "_framer",
        "_framing",
        "_last_upstream",
        "_last_write",
        "_limits",
        "_phase",
        "_provisional",
        "_terminal_seen",
        "_window",
        "gone",
        "meter",
        "transforms",
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
        self._framer: SSEFramer | LineFramer = (
            SSEFramer(limits.max_event_bytes)
            if self._framing == "sse"
            else LineFramer(limits.max_event_bytes)
        )
        self.meter = StreamMeter(started_at, gap_observer)
        self._calls = CallCheck(
            self.meter, limits.max_tool_arguments_bytes, limits.max_tool_arguments_depth
        )
        #: The stream's stages' transforms, in the plan's order (none: a plain stream).
        self.transforms: tuple[EventTransform, ...] = ()
        #: What a client leaving does (``on_client_gone``; detach: :meth:`detach_for`).
        self.gone = Gone.CANCEL
        self._window = 0.0
        self._phase = Phase.STREAMING
        # The response headers went out just now: keep-alives count from here.
        self._last_write = now
        self._last_upstream = now
        self._terminal_seen = False
        self._client_gone = False
        self._drain_deadline: float | None = None
        # on_client_gone: detach: the client left, the stream runs on into
        # its journal until this time unless someone resumes it.
        self._detach_deadline: float | None = None

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

    def open_tool_calls(self) -> list[dict[str, object]]:
        """The first :data:`~streamwarden.core.toolcalls.LISTED` tool calls open now (id,
        name, bytes of arguments so far): for ``/streams``, beside :attr:`open_tool_call_count`."""
        return self._calls.open_calls()

    @property
    def open_tool_call_count(self) -> int:
        """How many tool calls are open now (a stream may hold thousands: few are listed)."""
        return self._calls.open_count

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
        out = self._close_transforms(now) if self.transforms else b""
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
            self._end(EndState.UPSTREAM_ERROR, now)
        elif self._phase is Phase.DRAINING:
            self._end(EndState.DRAINED, now)
        elif self._terminal_seen or not (dialect.expects_terminal or partial):
            self._end(EndState.COMPLETED, now)
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

    def upstream_refused(self, now: float, code: ErrorCode, reason: str) -> bytes:
        """The upstream never delivered a stream after the client's response began.

        Only with early headers: the client already has ``200`` and
        keep-alives when the upstream fails to connect, times out, or answers
        with an error status or a body that is not a stream.
        """
        if self.done:
            return b""
        return self._fail(code, now, reason)

    # -- the lifecycle (its table: streamwarden.core.lifecycle) -----------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def next(self) -> Next:
        """What the face does next (the lifecycle's answer to the last input)."""
        return NEXT[self._phase]

    def detach_for(self, window: float) -> None:
        """A gone client leaves the stream running into its journal for ``window`` seconds."""
        self.gone = Gone.DETACH
        self._window = window

    def client_gone(self, now: float) -> Next | None:
        """The client disconnected: what the face does now (``None``: nothing new).

        By the stream's :attr:`gone` policy: ``cancel`` ends it
        ``client_cancelled``; ``drain`` reads the upstream on, writes
        nothing, and a clean end is ``drained``, with its final usage
        metered; ``detach`` runs it on into its journal for a client that
        resumes, until its window runs out. Later upstream content counts
        as zombie tokens (unless someone resumes it).
        """
        was = self._phase
        self._client_gone = True
        if was is Phase.ENDED or was is Phase.CLOSED:
            return None  # over already: the face finishes it as it would have
        if self._terminal_seen:
            self._end(EndState.COMPLETED, now)
        elif self.gone is Gone.DETACH and self._detach_deadline is None:
            self._detach_deadline = now + self._window
        return self._to(GONE_INPUT[self.gone], now, was)

    def held(self, now: float, left: float | None) -> Next | None:
        """The answer to ``ASK_HOLD``: a resumed client holds the stream ``left`` more seconds."""
        if self._phase is not Phase.EXPIRING:
            return None
        if left is None or left <= 0:
            return self._to(Input.NOT_HELD, now, Phase.EXPIRING)
        self._detach_deadline = now + left
        self.meter.resumed()
        return self._to(Input.HELD, now, Phase.EXPIRING)

    def stop(self, now: float) -> Next | None:
        """An explicit stop (``DELETE``) by the stream's owner: end it now."""
        was = self._phase
        answer = self._to(Input.STOP, now, was)
        if answer is not None:
            self._client_gone = True
        return answer

    def resumed(self) -> None:
        """A resumed client received what this stream's own client missed: no zombies."""
        self.meter.resumed()

    def client_too_slow(self, now: float) -> Next | None:
        """The client did not take our writes within ``client_write_timeout``."""
        self._client_gone = True
        return self._to(Input.TOO_SLOW, now, self._phase)

    def drain_by(self, deadline: float) -> None:
        """The process is draining: the stream may run on until ``deadline``, no longer.

        ``poll`` at or after it ends the stream with ``shutting_down`` (unless
        its answer was already whole). The one deadline that can move
        sooner: the face must wake its timer after calling this.
        """
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline

    def _to(self, event: Input, now: float, was: Phase) -> Next | None:
        """Move by the table; the face's next step if the phase changed (``None``: it did not)."""
        phase, state = step(self._phase, event)
        self._phase = phase
        if state is not None:
            self.meter.end(state, now)
        return NEXT[phase] if phase is not was else None

    def _end(self, state: EndState, now: float, code: ErrorCode | None = None) -> None:
        """Give the stream its end state (the first only), and its lifecycle its end."""
        self.meter.end(state, now, code)
        self._to(Input.ENDED, now, self._phase)

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
        if self._phase is Phase.EXPIRING:
            return b""  # the face asks for a hold first
        if self._detach_deadline is not None and now >= self._detach_deadline:
            self._to(Input.WINDOW_OUT, now, Phase.DETACHED)
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
        """Whole frames arrived: read each, keep the books, write what goes out.

        The one path of every frame. The meter counts a plain stream's text
        as it is read; through transforms, as it leaves them.
        """
        meter = self.meter
        # After the end (a gone client's zombie tokens) no stage acts any more.
        chain = len(self.transforms) > 0 and not self.done
        out: list[Frame] = []
        events = 0  # of the frames in out (through transforms)
        arrived = 0
        broken: ToolCall | None = None
        delivered = not self._client_gone
        for position, frame in enumerate(frames):
            event = frame.event
            if event is None:  # a comment or a stray line: it keeps its place
                if chain:
                    events += self._through([(frame, NOTHING)], now, out, 0)
                continue
            arrived += 1
            if self._provisional:
                self._provisional = False
                self._dialect = sniff(event, self._dialect)
            seen = self._dialect.inspect(event)
            if seen is not NOTHING:
                if seen.calls is not None or seen.terminal:
                    broken = self._calls.follow(seen)
                    if broken is not None:  # it and what follows it never go out
                        if not chain:
                            frames = frames[:position]
                        break
                if seen.text and not chain:
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
            if chain:
                events += self._through([(frame, seen)], now, out, 0)
                if self._stopped() is not None:
                    break
        meter.events_in += arrived
        if not chain:
            out = frames
            events = arrived - 1 if broken is not None else arrived
        written = self._emit(out, events, now) if out else b""
        if broken is not None:
            code, reason = self._calls.failure(broken)
            return written + self._fail(code, now, reason)
        stop = self._stopped() if chain else None
        return written if stop is None else written + self._fail(stop[0], now, stop[1], False)

    def _through(self, items: list[Passing], now: float, out: list[Frame], first: int) -> int:
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
        delivered = not self._client_gone
        events = 0
        for frame, seen in items:
            if frame.event is not None:
                events += 1
            if seen.text:
                meter.content(seen.text, now, delivered=delivered)
            out.append(frame)
        return events

    def _close_transforms(self, now: float) -> bytes:
        """The text ended: what waits in the transforms goes out (or a stop ends the stream)."""
        out: list[Frame] = []
        events = 0
        transforms = self.transforms
        for index in range(len(transforms)):
            released: list[Passing] = []
            transforms[index].close(now, released)
            if released:
                events += self._through(released, now, out, index + 1)
        written = self._emit(out, events, now) if out else b""
        stop = self._stopped()
        return written if stop is None else written + self._fail(stop[0], now, stop[1], False)

    def _stopped(self) -> Stop | None:
        """The first transform's reason to end the stream now, if one has one."""
        for transform in self.transforms:
            stop = transform.stop
            if stop is not None:
                return stop
        return None

    def _emit(self, frames: list[Frame], events: int, now: float) -> bytes:
        """Write whole frames (``events`` of them carry an event): count, return."""
        if self._client_gone:
            return b""
        out = frames[0].raw if len(frames) == 1 else b"".join([f.raw for f in frames])
        meter = self.meter
        meter.events_out += events
        meter.bytes_out += len(out)
        self._last_write = now
        return out

    def _end_or_fail(self, code: ErrorCode, now: float) -> bytes:
        # An answer whose terminal event was delivered is complete, whatever
        # happens to the connection afterwards.
        if self._terminal_seen and not self.meter.upstream_reported_error:
            self._end(EndState.COMPLETED, now)
            return b""
        return self._fail(code, now)

    def _fail(
        self, code: ErrorCode, now: float, reason: str | None = None, flush: bool = True
    ) -> bytes:
        """End the stream with an error event (``flush``: what waits in transforms goes first)."""
        if self.done:
            return b""
        out = b""
        if flush and self.transforms:
            out = self._close_transforms(now)
            if self.done:  # a stop while they let go (a block): its error went out
                return out
        state, template = ENDINGS[code]
        limits = self._limits
        reason = reason or template.format(
            terminal=self._dialect.terminal_event,
            idle=limits.upstream_idle_timeout,
            duration=limits.max_stream_duration,
            event_bytes=limits.max_event_bytes,
        )
        if code not in KEEP_CODE:
            framer = self._framer
            held = framer.held() if framer.pending_bytes else None
            inside = self._calls.inside(self._dialect, held)
            if inside is not None:  # the code says what it cut; the end state, why
                code = ErrorCode.TOOL_CALL_TRUNCATED
                reason = f"{reason}, {inside}"
        self._end(state, now, code)
        error = self._dialect.error_event(code, f"streamwarden: {reason} ({code})")
        for transform in self.transforms:
            error = transform.ending(error)  # a journal records it for a resumed client
        if self._client_gone:
            return out
        self.meter.bytes_out += len(error)
        return out + error
