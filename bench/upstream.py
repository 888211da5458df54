"""A lean synthetic LLM upstream: OpenAI-style token streams, stamped at send time.

Not the project's mock (``streamwarden mock-upstream``): the mock is an
aiohttp application with a task, a pacing loop and fault machinery per
stream, and it saturates one core at a few thousand events per second,
which is below what the sidecar must sustain. This server is one
``asyncio.Protocol`` per connection with a loop timer per stream (or one
timer per decode step for aligned streams): about 5 µs of CPU per event on
uvloop, so the upstream is never the bottleneck of a path it is compared on
(the harness reports its CPU use per window anyway).

Requests (the query string carries the knobs, the body is read and ignored):

- ``?tps=R&n=N``: ``N`` token events, one every ``1/R`` s on an absolute
  schedule of the stream's own (its phase is when its request arrived),
  the first at once; then a finishing chunk with usage and ``data:
  [DONE]``. Each event's ``id`` holds ``time.monotonic_ns()`` taken just
  before it is written.
- ``?tps=R&n=N&align=1``: the same events, but after the first one the
  stream joins the *decode step* of its rate: one timer per rate, on a grid
  of ``1/R`` s shared by every aligned stream, writes one event to each of
  them in turn, as a batching engine (vLLM, TGI, SGLang) emits the tokens
  of one step of its whole batch. Each write is still stamped just before
  it is made.
- ``?idle=1&cid=X``: response headers, then silence. When the connection
  closes, the time the close was seen is kept under ``X``.
- ``?mode=json&n=N``: a non-streamed completion with ``Content-Length``.
- ``GET /_bench/closes``: the close times recorded so far (and forget them).
- ``GET /_bench/health``: 200.

Run: ``python -m bench.upstream --listen 127.0.0.1:0``; it prints
``READY <port>`` once it listens and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from typing import cast

from bench import procfs
from bench.wire import (
    LAST_CHUNK,
    SSE_HEAD,
    ChunkedDecoder,
    Head,
    chunk,
    completion_body,
    final_events,
    json_response,
    token_event,
)

_MAX_HEAD = 64 * 1024


class Upstream:
    """State shared by every connection: the recorded close times, the decode steps."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.closes: dict[str, int] = {}
        self.steps: dict[float, DecodeStep] = {}

    def step(self, period: float) -> DecodeStep:
        step = self.steps.get(period)
        if step is None:
            step = self.steps[period] = DecodeStep(self.loop, period)
        return step


class DecodeStep:
    """One batch's decode steps: every ``period`` s, one event to each member stream.

    The steps sit on a grid of the loop's clock (multiples of ``period``), so
    every aligned stream of one rate, whenever it started, gets its events
    in the same callback as all the others. Members are written in the order
    they joined, as an engine walks its batch.
    """

    __slots__ = ("_index", "_loop", "_period", "_running", "_timer", "members")

    def __init__(self, loop: asyncio.AbstractEventLoop, period: float) -> None:
        self._loop = loop
        self._period = period
        self._timer: asyncio.TimerHandle | None = None
        self._running = False
        #: The grid index of the next step (an integer: a float grid read back
        #: from a millisecond clock can land a hair before its own step).
        self._index = 0
        #: The streams in the batch (a dict: insertion-ordered, O(1) removal).
        self.members: dict[Connection, None] = {}

    def join(self, member: Connection) -> None:
        self.members[member] = None
        if self._timer is None and not self._running:
            self._arm()

    def leave(self, member: Connection) -> None:
        self.members.pop(member, None)
        if not self.members and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        period = self._period
        # The next step of the grid, never one already run, never one long past.
        self._index = max(self._index + 1, int(self._loop.time() / period))
        self._timer = self._loop.call_at(self._index * period, self._run)

    def _run(self) -> None:
        self._timer = None
        self._running = True
        try:
            # A copy: a stream leaves as it ends, and its connection's next
            # request (a proxy's pooled connection) may join meanwhile.
            for member in list(self.members):
                member.step()
        finally:
            self._running = False
        if self.members:
            self._arm()


class Connection(asyncio.Protocol):
    """One client connection (a proxy's pooled connection, or the load client's)."""

    __slots__ = (
        "_body_left",
        "_buf",
        "_cid",
        "_closed",
        "_dechunk",
        "_head",
        "_k",
        "_loop",
        "_n",
        "_period",
        "_server",
        "_start",
        "_step",
        "_streaming",
        "_timer",
        "_transport",
    )

    def __init__(self, server: Upstream, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._head: Head | None = None
        self._body_left = 0
        self._dechunk: ChunkedDecoder | None = None
        self._streaming = False
        self._closed = False
        self._cid: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._k = 0
        self._n = 0
        self._period = 0.0
        self._start = 0.0
        #: The decode step this stream is aligned to, if it is.
        self._step: DecodeStep | None = None

    # -- asyncio callbacks ---------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._streaming:
            self._parse()

    def eof_received(self) -> bool | None:
        self._gone()
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()

    # -- requests ------------------------------------------------------------

    def _gone(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The first thing done on hearing of the close, so the stamp is as
        # close as this process can get to the moment the FIN arrived.
        if self._cid is not None:
            self._server.closes[self._cid] = time.monotonic_ns()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._step is not None:
            self._step.leave(self)
            self._step = None

    def _parse(self) -> None:
        buf = self._buf
        while not self._streaming and not self._closed:
            head = self._head
            if head is None:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        self._abort()
                    return
                head = self._head = Head(bytes(buf[:end]))
                del buf[: end + 4]
                if head.chunked:
                    self._dechunk = ChunkedDecoder()
                else:
                    self._body_left = head.content_length or 0
            if self._dechunk is not None:
                self._dechunk.feed(bytes(buf))
                buf.clear()
                if not self._dechunk.done:
                    return
                buf += self._dechunk.leftover()
                self._dechunk = None
            elif self._body_left:
                take = min(self._body_left, len(buf))
                del buf[:take]
                self._body_left -= take
                if self._body_left:
                    return
            self._head = None
            self._respond(head)

    def _respond(self, head: Head) -> None:
        transport = self._transport
        assert transport is not None
        _, _, rest = head.first.partition(" ")
        target = rest.rsplit(" ", 1)[0]
        path, _, query = target.partition("?")
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        if path == "/_bench/closes":
            body = json.dumps(self._server.closes).encode()
            self._server.closes = {}
            transport.write(json_response(body))
            return
        if path == "/_bench/health":
            transport.write(json_response(b'{"status":"ok"}'))
            return
        n = int(params.get("n", "20"))
        if params.get("mode") == "json":
            transport.write(json_response(completion_body(time.monotonic_ns(), n)))
            return
        transport.write(SSE_HEAD)
        self._streaming = True
        if params.get("idle") == "1":
            self._cid = params.get("cid")
            return
        self._n = n
        self._k = 0
        self._period = 1.0 / float(params.get("tps", "50"))
        self._start = self._loop.time()
        if params.get("align") == "1":
            # The first event at once (the prefill is done), the rest in step.
            if not self.step():
                self._step = self._server.step(self._period)
                self._step.join(self)
            return
        self._tick()

    def step(self) -> bool:
        """Write the stream's next event (or its end); ``True`` once the stream is done."""
        if self._closed:
            return True
        transport = self._transport
        assert transport is not None
        k = self._k
        if k < self._n:
            transport.write(chunk(token_event(time.monotonic_ns(), k)))
            self._k = k + 1
            return False
        step, self._step = self._step, None
        if step is not None:
            step.leave(self)
        self._end()
        return True

    def _end(self) -> None:
        transport = self._transport
        assert transport is not None
        transport.write(chunk(final_events(time.monotonic_ns(), self._n)) + LAST_CHUNK)
        self._streaming = False
        self._parse()  # a proxy's pooled connection may already carry the next request

    def _tick(self) -> None:
        self._timer = None
        if not self.step():
            self._timer = self._loop.call_at(self._start + self._k * self._period, self._tick)

    def _abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    state = Upstream(loop)
    server = await loop.create_server(
        lambda: Connection(state, loop), host, port, backlog=4096, reuse_address=True
    )
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream")
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (loopback only)")
    parser.add_argument("--asyncio", action="store_true", help="plain asyncio, not uvloop")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    procfs.raise_fd_limit()
    procfs.run(serve(host, int(port)), uvloop=not args.asyncio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
