"""The one driver of every streamed response, and the copier of every other body.

Each upstream read is handled inside the upstream connection's
``data_received``: the parser hands the body to :class:`StreamDriver` (a
:class:`~streamwarden.net.upstream.BodySink`), which inflates it if it
is compressed, feeds it to the stream's :class:`~streamwarden.core.relay.Relay`
and writes whatever whole events that read completed to the client in one
write. No queue, no task wake-up per event. The stream's task only does
what only a task can: wait for the relay's next deadline (keep-alive, idle
timeout, duration, drain, all of them the relay's), for a congested client
(bounded by ``client_write_timeout``), and, with early headers, for the
upstream's response head.

Two bounds hold whatever the upstream sends:

- **Work per loop turn.** At most ``TURN_BUDGET`` bytes (inflated) reach the
  relay per upstream read or per turn of the task; the rest waits, with the
  upstream paused, for the task's next turn. One upstream flooding tiny
  events (or a decompression bomb) cannot hold the event loop, so other
  streams and the admin port keep their latency.
- **Memory.** The inflater yields at most one budget per step and keeps the
  compressed input it has not consumed; a congested client pauses the
  upstream and the inflation alike. What the relay holds is bounded by
  ``max_event_bytes``.

:class:`PassThrough` copies a body that is not a stream, byte for byte, with
the same flow control and ``client_write_timeout``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Final

from streamwarden.core.inflate import InflateError, Inflater
from streamwarden.core.lifecycle import Next
from streamwarden.core.plan import StreamPlan
from streamwarden.core.relay import ErrorCode, Relay
from streamwarden.net.upstream import (
    Exchange,
    HeadTimeout,
    NativeSink,
    ResponseHead,
    UpstreamError,
    UpstreamUnreachable,
)
from streamwarden.sidecar.channel import ClientChannel
from streamwarden.sidecar.deadlines import Deadlines, Wait
from streamwarden.sidecar.http import CLIENT_GONE
from streamwarden.sidecar.streams import ActiveStream

__all__ = ["TURN_BUDGET", "PassThrough", "StreamDriver"]

#: Most bytes handed to the relay per upstream read or task turn. 4 KiB of
#: the smallest events is about 450 events, a millisecond or two of work.
TURN_BUDGET: Final = 4 * 1024


class _Conduit(NativeSink):
    """What both bodies share: output gathered per read, client flow control.

    A :class:`NativeSink`, so the upstream connection calls ``body`` and
    ``read_done`` directly.
    """

    __slots__ = (
        "_channel",
        "_congested",
        "_error",
        "_exchange",
        "_loop",
        "_out",
        "_pending",
        "_read",
        "_read_chunk",
        "_waiter",
        "_write_timeout",
    )

    def __init__(self, channel: ClientChannel, write_timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._channel = channel
        self._write_timeout = write_timeout
        self._exchange: Exchange | None = None
        # What this read produced: nearly always one piece, kept as is; a
        # list only for the pieces after it.
        self._out = b""
        self._pending: list[bytes] = []
        # This read's one chunk, and the read's bytes that frame it as the
        # client's chunk would be (``body_as_read``): written as they came
        # when that chunk is what goes out, unchanged.
        self._read = b""
        self._read_chunk = b""
        self._waiter: asyncio.Future[None] | None = None
        #: The client's transport passed its high-water mark: upstream paused.
        self._congested = False
        #: Something the task must act on (end, error, backlog) happened.
        self._error: BaseException | None = None

    # -- output --------------------------------------------------------------

    # Bytes are tested by their length here, not their truth: the compiled
    # build reads a length in place and asks CPython for a truth (three or
    # four times per read).
    def _gather(self, out: bytes) -> None:
        if len(out):
            if len(self._out):
                self._pending.append(out)
            else:
                self._out = out

    def body_as_read(self, chunk: bytes, read: bytes) -> None:
        self._read = read
        self._read_chunk = chunk
        self.body(chunk)

    def flush(self) -> None:
        """Write what this read (or turn) produced, in one write."""
        out = self._out
        read = self._read
        if len(read):
            self._read = b""
            if out is not self._read_chunk or self._pending:
                read = b""  # what goes out is not that chunk as it came
            self._read_chunk = b""
        if not len(out):
            return
        self._out = b""
        pending = self._pending
        if pending:
            out = b"".join([out, *pending])
            pending.clear()
        channel = self._channel
        if len(read):
            channel.write_as_read(out, read)
        else:
            channel.write(out)
        if not self._congested and channel.congested:
            self._congested = True
            self._pause_upstream()
            self._wake()
            self._paused(True)

    # -- the task's side -----------------------------------------------------

    async def _sleep(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait_for_client(self) -> bool:
        """Until the congested client takes our bytes; ``False`` if it was too slow."""
        try:
            async with asyncio.timeout(self._write_timeout or None):
                await self._channel.writable()
        except TimeoutError:
            return False
        except CLIENT_GONE:
            pass  # the client left meanwhile: the relay already knows what that means
        self._congested = False
        self._paused(False)
        return True

    def _paused(self, paused: bool) -> None:
        """For the live view of streams (``GET /streams``); a copier has none."""

    def _pause_upstream(self) -> None:
        if self._exchange is not None:
            self._exchange.connection.pause_reading()

    def _resume_upstream(self) -> None:
        if self._exchange is not None:
            self._exchange.connection.resume_reading()

    def _wrap(self, exc: Exception) -> None:
        # A bug in a callback must surface in the task, not inside asyncio's
        # protocol machinery (where it would only be logged).
        self._error = exc
        self._wake()


class StreamDriver(_Conduit):
    """Drives one streamed response from upstream bytes to client writes."""

    __slots__ = (
        "_backlog",
        "_clock",
        "_deadlines",
        "_due",
        "_ending",
        "_holds",
        "_inflater",
        "_opening",
        "_spent",
        "_timer",
        "relay",
        "stream",
    )

    def __init__(
        self,
        channel: ClientChannel,
        stream: ActiveStream,
        plan: StreamPlan,
        write_timeout: float,
        *,
        holds: Callable[[], Awaitable[float | None]] | None = None,
        deadlines: Deadlines,
    ) -> None:
        super().__init__(channel, write_timeout)
        #: The loop's clock, read at every upstream read: bound once for the
        #: process (a method called by name is looked up at each call).
        self._clock = deadlines.clock()
        #: For a detached stream: how to ask whether a resume holds it.
        self._holds = holds
        self.stream = stream
        self.relay: Relay = stream.relay
        self._inflater = Inflater(plan.encoding) if plan.decoded else None
        #: Raw (identity) body bytes waiting for a later turn (made on first
        #: use: an empty deque is 0.7 KiB, and most streams never need one).
        self._backlog: deque[bytes] | None = None
        #: Bytes handed to the relay in this read or turn.
        self._spent = 0
        #: The body's end (True) or break, held until the backlog is through.
        self._ending: UpstreamError | bool = False
        #: With early headers: the request still waiting for its answer.
        self._opening: asyncio.Future[Exchange] | None = None
        #: While the task waits: its entry for the relay's deadline.
        self._timer: Wait | None = None
        self._deadlines = deadlines
        #: The deadline passed (or the drain moved it to now) while it waited.
        self._due = False

    # -- from the upstream connection (BodySink) ------------------------------

    def _paused(self, paused: bool) -> None:
        self.stream.paused = paused

    def body(self, chunk: bytes) -> None:
        try:
            if self._inflater is not None:
                self._inflater.feed(chunk)
                if not self._congested:
                    self._inflate()
            elif self._backlog or self._congested:
                self._queue().append(chunk)
            else:
                self._take(chunk)
        except Exception as exc:
            self._wrap(exc)

    def read_done(self) -> None:
        self._spent = 0
        if self._has_backlog():
            self._pause_upstream()
            self._wake()
        self.flush()

    def body_end(self) -> None:
        self._ending = True
        self._settle()

    def body_broken(self, error: UpstreamError) -> None:
        self._ending = error
        self._settle()

    # -- the client's side ---------------------------------------------------

    def client_gone(self) -> None:
        """The client closed or reset: act on what the relay says follows."""
        noticed = self._clock()
        relay = self.relay
        action = relay.client_gone(noticed)
        if action is Next.READ_ON:
            # Read on, write nothing (drain, detach): the relay meters the
            # rest, or journals it for a resume.
            self._congested = False
            if not self._has_backlog():
                self._resume_upstream()
            self._wake()
            return
        if action is not Next.CLOSE:
            return  # over already: the usual cleanup decides the connection
        if self._exchange is not None:
            self._exchange.connection.hang_up()
        elif self._opening is not None:
            self._opening.cancel()  # closes the connection still waiting for a head
        relay.meter.cancel_propagation = self._clock() - noticed
        self._wake()

    # -- the task ------------------------------------------------------------

    def run(self, exchange: Exchange) -> Coroutine[object, object, None]:
        """Relay the body of ``exchange`` until the stream ends (the head is sent).

        Not a coroutine itself: what it returns is the one the stream's task
        awaits, a frame less in every open stream.
        """
        self._exchange = exchange
        exchange.attach(self)
        self.flush()
        return self._drive()

    async def run_early(
        self,
        opening: asyncio.Future[Exchange],
        refuse: Callable[[ResponseHead], str | None],
    ) -> None:
        """Keep the client alive while the upstream thinks, then relay its stream.

        The client already has ``200 text/event-stream``; an upstream that
        fails, times out, answers with an error status or with something
        that is not an event stream becomes an error event (``refuse``
        says why, or ``None`` to relay it).
        """
        relay = self.relay
        loop = self._loop
        self._opening = opening
        while not opening.done() and not relay.done:
            waiter = self._rest(relay.deadline)
            opening.add_done_callback(self._opened)  # never cancels the opening itself
            try:
                await waiter
            finally:
                opening.remove_done_callback(self._opened)
                self._rested()
            if self._due:
                await self._deadline_passed()
            if self._congested and not await self._wait_for_client():
                self._too_slow()
                return
        self._opening = None
        if relay.done:
            opening.cancel()
            return
        failure = opening.exception()
        if failure is not None:
            if isinstance(failure, HeadTimeout):
                code, what = ErrorCode.UPSTREAM_TIMEOUT, "the upstream did not answer in time"
            elif isinstance(failure, UpstreamError):
                code, what = ErrorCode.UPSTREAM_ERROR, "the upstream could not be reached"
                if not isinstance(failure, UpstreamUnreachable):
                    what = "the upstream broke off before answering"
            else:
                raise failure
            self._gather(relay.upstream_refused(loop.time(), code, what))
            self.flush()
            return
        exchange = opening.result()
        refusal = refuse(exchange.head)
        if refusal is not None:
            exchange.finish()
            self._gather(relay.upstream_refused(loop.time(), ErrorCode.UPSTREAM_ERROR, refusal))
            self.flush()
            return
        await self.run(exchange)

    async def _drive(self) -> None:
        relay = self.relay
        while not relay.done:
            if self._error is not None:
                raise self._error
            if self._congested:
                if not await self._wait_for_client():
                    self._too_slow()
                    return
                if self._inflater is not None:
                    self._inflate()
                self._settle()
                self.flush()
                if not self._congested and not self._has_backlog():
                    self._resume_upstream()
                continue
            if self._has_backlog():
                # One budget per turn: let every other stream and the admin
                # port have theirs first.
                await asyncio.sleep(0)
                self._spent = 0
                if self._inflater is not None:
                    self._inflate()
                else:
                    self._take_backlog()
                self._settle()
                self.flush()
                if not self._has_backlog() and not self._congested:
                    self._resume_upstream()
                continue
            # Traffic only moves the relay's deadline later, so this one
            # timer may fire early; poll() then finds nothing due. (A timer
            # per read cost a sixth of the CPU per event.)
            waiter = self._rest(relay.deadline)
            try:
                await waiter
            finally:
                self._rested()
            if self._due:
                await self._deadline_passed()
        self.flush()
        if self._error is not None:
            raise self._error

    # -- the wait for the relay's deadline ------------------------------------
    #
    # An entry in the process's one deadline heap that wakes the task's
    # future, not ``asyncio.timeout`` around a sleeping coroutine: an idle
    # stream spends its life in this wait, and the timeout's object, its
    # loop timer and the coroutine's frame were about 1.4 KiB of every idle
    # stream's memory on uvloop.

    def _rest(self, deadline: float | None) -> asyncio.Future[None]:
        """The future the task waits on until it is woken or ``deadline`` passes."""
        self._due = False
        waiter = self._waiter = self._loop.create_future()
        if deadline is not None:
            self._timer = self._deadlines.at(deadline, self)
        self.stream.sleeper = self
        return waiter

    def _rested(self) -> None:
        self._waiter = None
        self.stream.sleeper = None
        timer = self._timer
        if timer is not None:
            self._timer = None
            self._deadlines.cancel(timer)

    def deadline_now(self) -> None:
        """The relay's deadline passed, or moved to now (the drain): the task polls it."""
        self._due = True
        self._wake()

    def _opened(self, _: object) -> None:
        self._wake()

    async def _deadline_passed(self) -> None:
        relay = self.relay
        self._gather(relay.poll(self._clock()))
        self.flush()
        if relay.next is Next.ASK_HOLD:
            # A detached stream's window ran out: does a resumed client hold it?
            holds = self._holds
            left = None if holds is None else await holds()
            if relay.held(self._clock(), left) is Next.CLOSE:
                self._close_upstream()

    def _close_upstream(self) -> None:
        if self._exchange is not None:
            self._exchange.connection.hang_up()
        elif self._opening is not None:
            self._opening.cancel()  # closes the connection still waiting for a head

    def stop(self) -> None:
        """An explicit stop by the stream's owner: end the stream, close the upstream."""
        if self.relay.stop(self._clock()) is Next.CLOSE:
            self._close_upstream()
            self._wake()

    def finish(self) -> None:
        """After the stream: the connection back to the pool if whole, else closed."""
        self._channel.on_gone(None)
        if self._exchange is not None:
            self._exchange.finish()
            self._exchange = None

    # -- internals -------------------------------------------------------------

    def _has_backlog(self) -> bool:
        inflater = self._inflater
        if inflater is not None:
            return inflater.pending
        return bool(self._backlog)

    def _take(self, chunk: bytes) -> None:
        """Feed the relay up to this read's budget; keep the rest for later turns."""
        room = TURN_BUDGET - self._spent
        if len(chunk) > room:
            # Ahead of anything queued: this chunk came first (it is either
            # new with an empty backlog, or the backlog's head).
            self._queue().appendleft(chunk[room:])
            chunk = chunk[:room]
        self._spent += len(chunk)
        self._gather(self.relay.feed(chunk, self._clock()))

    def _queue(self) -> deque[bytes]:
        if self._backlog is None:
            self._backlog = deque()
        return self._backlog

    def _take_backlog(self) -> None:
        backlog = self._queue()
        while backlog and self._spent < TURN_BUDGET and not self._congested:
            self._take(backlog.popleft())
            if self.relay.done:
                backlog.clear()

    def _inflate(self) -> None:
        inflater = self._inflater
        assert inflater is not None
        relay = self.relay
        while inflater.pending and self._spent < TURN_BUDGET:
            try:
                out = inflater.take(TURN_BUDGET - self._spent)
            except InflateError:
                self._gather(relay.upstream_failed(self._clock()))
                self._ending = False
                self._discard_inflater()
                self._wake()
                return
            self._spent += len(out)
            if out:
                self._gather(relay.feed(out, self._clock()))
            if relay.done:
                self._discard_inflater()
                self._wake()
                return

    def _discard_inflater(self) -> None:
        # Nothing more will be inflated for this stream (it ended).
        self._inflater = None

    def _settle(self) -> None:
        """Act on the body's end once everything before it went through the relay."""
        ending = self._ending
        if ending is False or self._has_backlog():
            return
        self._ending = False
        relay = self.relay
        now = self._clock()
        if ending is True:
            self._gather(relay.upstream_eof(now))
        else:
            self._gather(relay.upstream_failed(now))
        self.flush()
        self._wake()

    def _too_slow(self) -> None:
        self.relay.client_too_slow(self._clock())
        self._channel.abort()
        if self._exchange is not None:
            self._exchange.connection.close()


class PassThrough(_Conduit):
    """Copies a body that is not a stream to the client, byte for byte, flow-controlled."""

    __slots__ = ("ended",)

    def __init__(self, channel: ClientChannel, exchange: Exchange, write_timeout: float) -> None:
        super().__init__(channel, write_timeout)
        self._exchange = exchange
        #: None while the body runs; True once whole; an error if it broke.
        self.ended: UpstreamError | bool | None = None

    def body(self, chunk: bytes) -> None:
        self._gather(chunk)

    def read_done(self) -> None:
        self.flush()

    def body_end(self) -> None:
        self.flush()
        self.ended = True
        self._wake()

    def body_broken(self, error: UpstreamError) -> None:
        self.flush()
        self.ended = error
        self._wake()

    def client_gone(self) -> None:
        if self.ended is None and self._exchange is not None:
            self._exchange.connection.hang_up()
        self._wake()

    async def run(self) -> bool:
        """Copy until the body ends; ``True`` if it ended whole (else the client is cut)."""
        exchange = self._exchange
        assert exchange is not None
        exchange.attach(self)
        self.flush()
        while self.ended is None:
            if self._channel.closed:
                exchange.connection.close()
                return False
            if self._congested:
                if not await self._wait_for_client():
                    break
                self._resume_upstream()
                continue
            await self._sleep()
        if self.ended is not True:
            # A short body must not pass for a whole one: cut the client too.
            self._channel.abort()
            exchange.connection.close()
            return False
        return True

    def finish(self) -> None:
        self._channel.on_gone(None)
        if self._exchange is not None:
            self._exchange.finish()
            self._exchange = None
