"""Relaying a stream inside the upstream connection's data callback.

The plain way to relay an aiohttp client response is a task that awaits
``content.readany()``: aiohttp's parser queues each body chunk in the
response's ``StreamReader``, a future wakes the task on the next loop turn,
the task feeds the relay and awaits ``StreamResponse.write``. For a token
stream that is a queue, a wake-up and two coroutine frames per event, about
40% of the sidecar's CPU per event (bench/README.md).

Here the parser's ``feed_data`` hands each chunk to the relay at once, and
whatever whole events the relay releases from one read of the upstream
socket go to the client's transport in one write, chunk-framed, as soon as
that read is parsed, in the same callback. The stream's task is left with
what only a task can do: wait for a timer (keep-alive, idle timeout,
duration, drain) and for a slow client.

Flow control stays end to end. When the client's transport passes its
high-water mark, the upstream connection stops being read (its protocol's
``pause_reading``, as aiohttp's own reader does when its buffer fills) and
the task waits for the client to take its bytes, bounded by
``client_write_timeout``; then reading resumes.

This leans on things aiohttp does not promise: the body reader's class
and the client protocol's class can be swapped for subclasses without
fields of their own, the parser feeds the body through
``feed_data``/``feed_eof``/``set_exception`` inside the protocol's
``data_received``, and the server protocol has ``_drain_helper``.
:func:`usable` checks the classes, and the proxy falls back to the plain
loop otherwise (an HTTP/1.0 client, a non-chunked response, an aiohttp
whose reader or protocol is another class); the fault tests run both.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.client_proto import ResponseHandler

from streamwarden.relay import Relay
from streamwarden.sidecar.http import CLIENT_GONE, wait_writable, writing_paused
from streamwarden.sidecar.streams import ActiveStream

__all__ = ["pump", "usable"]


class _Sink:
    """Takes the upstream body from the parser and relays it to the client."""

    __slots__ = (
        "_client",
        "_decoder",
        "_loop",
        "_pending",
        "_request",
        "_upstream_protocol",
        "_waiter",
        "congested",
        "error",
        "reading",
        "relay",
    )

    def __init__(
        self,
        request: web.Request,
        client: asyncio.Transport,
        upstream_protocol: Any,
        relay: Relay,
        decoder: Any,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._request = request
        self._client = client
        self._upstream_protocol = upstream_protocol
        self._decoder = decoder
        self.relay = relay
        self._waiter: asyncio.Future[None] | None = None
        #: Relay output of the read being parsed (see _gather).
        self._pending: list[bytes] = []
        #: The upstream protocol is parsing a read (set by _RelayedProtocol).
        self.reading = False
        #: The client's transport is over its high-water mark; upstream paused.
        self.congested = False
        #: An exception from the relay, raised again in the stream's task.
        self.error: BaseException | None = None

    # -- from the parser (callbacks) -----------------------------------------

    def data(self, chunk: bytes) -> None:
        # Even after the stream's end: the relay meters what a gone client
        # would have got (zombie tokens) and returns nothing to write.
        if self.error is not None:
            return
        try:
            if self._decoder is not None:
                chunk = self._decoder.decompress(chunk)
            self._gather(self.relay.feed(chunk, self._loop.time()))
        except Exception as exc:  # a bug here must surface in the task, not in aiohttp
            self.error = exc
            self._wake()

    def eof(self) -> None:
        if not self.relay.done:
            self._gather(self.relay.upstream_eof(self._loop.time()))

    def failed(self) -> None:
        if not self.relay.done:
            self._gather(self.relay.upstream_failed(self._loop.time()))

    def _gather(self, out: bytes) -> None:
        """Hold the parser's output until the whole read it came in is parsed.

        The parser hands over one HTTP chunk at a time, and one read often
        carries several (a burst of events): they leave in one write, when
        the upstream protocol has parsed the read (see _RelayedProtocol), as
        the plain loop wrote one ``readany()``. Output from anywhere else (the
        end of the body seen in ``connection_lost``) is written at once.
        """
        if out:
            self._pending.append(out)
            if not self.reading:
                self.flush()
        if self.relay.done:
            self._wake()

    # -- to the client -------------------------------------------------------

    def flush(self) -> None:
        """Write what the parser's callbacks gathered."""
        pending = self._pending
        if pending:
            out = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            self._write(out)

    def deliver(self, out: bytes) -> None:
        """Write output of the task's own (timers, drain), after what is gathered."""
        self.flush()
        if out:
            self._write(out)
        if self.relay.done:
            self._wake()

    def _write(self, out: bytes) -> None:
        client = self._client
        if client.is_closing():
            return
        # The response is chunked (see usable()): one HTTP chunk per write.
        client.write(b"%x\r\n%b\r\n" % (len(out), out))
        if not self.congested and writing_paused(self._request):
            self.congested = True
            self._upstream_protocol.pause_reading()
            self._wake()

    # -- the task's side -----------------------------------------------------

    async def wait(self) -> None:
        """Until the relay is done, the client is congested, or an error (or cancellation)."""
        if self.relay.done or self.congested or self.error is not None:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def uncongest(self) -> None:
        self.congested = False
        self._upstream_protocol.resume_reading()


# Body readers and client protocols being relayed, by id (the reader class
# has no room for a field).
_SINKS: dict[int, _Sink] = {}


class _RelayedReader(aiohttp.StreamReader):
    """aiohttp's body reader, passing what the parser feeds it to its sink."""

    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        sink = _SINKS.get(id(self))
        if sink is None:
            return super().feed_data(data, size)
        if data:
            sink.data(data)
        return False

    def feed_eof(self) -> None:
        super().feed_eof()  # runs aiohttp's own end-of-body callbacks (pooling)
        sink = _SINKS.get(id(self))
        if sink is not None:
            sink.eof()

    def set_exception(self, exc: BaseException, *args: Any, **kwargs: Any) -> None:
        super().set_exception(exc, *args, **kwargs)
        sink = _SINKS.get(id(self))
        if sink is not None:
            sink.failed()


class _RelayedProtocol(ResponseHandler):
    """aiohttp's client protocol, writing out each read's events once it is parsed."""

    def data_received(self, data: bytes) -> None:
        sink = _SINKS.get(id(self))
        if sink is None:
            super().data_received(data)
            return
        sink.reading = True
        try:
            super().data_received(data)
        finally:
            sink.reading = False
            sink.flush()


def usable(
    request: web.Request, upstream: aiohttp.ClientResponse, response: web.StreamResponse
) -> bool:
    """Whether this stream can be relayed from the callback (else: the plain loop)."""
    connection = upstream.connection
    return (
        type(upstream.content) is aiohttp.StreamReader
        and connection is not None
        and type(connection.protocol) is ResponseHandler
        and connection.transport is not None
        and request.transport is not None
        and writing_paused(request) is not None
        and response.headers.get("Transfer-Encoding", "").lower() == "chunked"
    )


async def pump(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    stream: ActiveStream,
    decoder: Any,
    write_timeout: float,
) -> None:
    """Relay the stream from the parser's callbacks; run its timers and flow control.

    Call only when :func:`usable` says so, after ``response.prepare``.
    """
    loop = asyncio.get_running_loop()
    relay = stream.relay
    body = upstream.content
    client = request.transport
    connection = upstream.connection
    assert client is not None and connection is not None
    assert connection.protocol is not None and connection.transport is not None
    sink = _Sink(request, client, connection.protocol, relay, decoder)
    # What the parser fed before now is in the reader's buffer already.
    if body.exception() is not None:
        sink.failed()
    else:
        buffered = body.read_nowait()
        if buffered:
            sink.data(buffered)
        if body.is_eof():
            sink.eof()
    sink.flush()
    protocol, transport = connection.protocol, connection.transport
    _SINKS[id(body)] = _SINKS[id(protocol)] = sink
    body.__class__ = _RelayedReader
    # uvloop caches a protocol's data_received: set_protocol makes it look again.
    protocol.__class__ = _RelayedProtocol
    transport.set_protocol(protocol)
    try:
        while not relay.done and sink.error is None:
            if stream.draining:
                # Told while waiting for the client: there was no timer to wake.
                sink.deliver(relay.shutdown(loop.time()))
                continue
            if sink.congested:
                try:
                    async with asyncio.timeout(write_timeout or None):
                        await wait_writable(request)
                except TimeoutError:
                    relay.client_too_slow(loop.time())
                    client.abort()
                    return
                sink.uncongest()
                continue
            try:
                # Traffic only moves the relay's deadline later, so the timer
                # may fire early; poll() then finds nothing due.
                async with asyncio.timeout_at(relay.deadline) as timer:
                    stream.timer = timer
                    await sink.wait()
            except TimeoutError:
                now = loop.time()
                sink.deliver(relay.shutdown(now) if stream.draining else relay.poll(now))
            finally:
                stream.timer = None
        sink.flush()  # the stream's last events, if the task woke before their turn
    finally:
        _SINKS.pop(id(body), None)
        _SINKS.pop(id(protocol), None)
        body.__class__ = aiohttp.StreamReader
        protocol.__class__ = ResponseHandler
        if not transport.is_closing():
            transport.set_protocol(protocol)
    if sink.error is not None:
        raise sink.error
    with contextlib.suppress(*CLIENT_GONE):
        await response.write_eof()
