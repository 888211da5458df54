"""The floor: the thinnest HTTP/1.1 streaming reverse proxy Python on uvloop can be.

Not a product, a lower bound. It answers one question: what does any
Python proxy on uvloop cost per event on this machine, before it does any
work of its own (parsing SSE, metering, deadlines)? What the sidecar costs
beyond this is the sidecar's; what this costs beyond nginx is Python's and
uvloop's, and no change to the sidecar can win it back.

One ``asyncio.Protocol`` per client connection. Two modes:

- ``raw`` (path ``floor``): one upstream connection per client connection,
  opened when the client connects; bytes are forwarded as they arrive in
  ``data_received``, both ways, untouched (the request head and body as
  the client sent them, the response's chunked framing as the upstream
  sent it). Nothing is parsed, so the upstream connection cannot be kept
  for another client: it closes when the client does. That is enough for
  the benchmark, where every client connection carries one stream.
- ``httptools`` (path ``floor-httptools``): the same, plus httptools
  parsing the response (callbacks for the body and the message's end, as
  the sidecar's upstream client has them) and the body re-framed as one
  chunk per upstream read, so the parser's and the re-framing's cost can
  be told from the floor's; the upstream connection goes back to a small
  keep-alive pool when its response ends, as nginx's ``keepalive`` does.

Back-pressure: the client transport's ``pause_writing`` pauses reading the
upstream, ``resume_writing`` resumes it; no per-event cost.

``floor-burnN`` (path): the raw floor plus N µs of busy Python per
upstream read, a stand-in for a proxy's own work per event.

Run: ``python -m bench.floor --listen 127.0.0.1:PORT --upstream HOST:PORT
[--httptools]``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from time import perf_counter
from typing import Any

from bench import procfs

_HEAD_END = b"\r\n\r\n"


class Upstream(asyncio.Protocol):
    """The proxy's connection to the upstream: every byte read goes to the client."""

    __slots__ = ("client", "transport")

    def __init__(self, client: Client) -> None:
        self.client: Client | None = client
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None:
            client.transport.write(data)


class BurningUpstream(Upstream):
    """The floor plus ``burn`` seconds of busy Python per read, before the write.

    Stands in for a proxy's own per-event work: whether CPU per event is
    then the floor's plus the burn, or more (the kernel's share growing as
    the proxy gets busier), says how much of a slower proxy's excess is its
    own code.
    """

    __slots__ = ()
    burn = 0.0

    def data_received(self, data: bytes) -> None:
        end = perf_counter() + self.burn
        while perf_counter() < end:
            pass
        client = self.client
        if client is not None:
            client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.upstream_gone()


class ParsedUpstream(asyncio.Protocol):
    """The same, with httptools parsing the response and the body re-framed per read."""

    __slots__ = ("_body", "client", "parser", "pool", "transport")

    def __init__(self, pool: Pool) -> None:
        import httptools

        self.pool = pool
        self.client: Client | None = None
        self.transport: Any = None
        self._body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    # httptools callbacks
    def on_headers_complete(self) -> None:
        client = self.client
        if client is not None:
            parser = self.parser
            # The head as the client will see it: status, and chunked framing
            # (the body is re-framed below). Enough for the benchmark's SSE.
            client.transport.write(
                b"HTTP/1.1 %d OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" % parser.get_status_code()
            )

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self._flush(client)
            client.transport.write(b"0\r\n\r\n")
            client.upstream = None
            self.pool.put(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self._body:
            client = self.client
            if client is not None:
                self._flush(client)

    def _flush(self, client: Client) -> None:
        body = self._body
        if body:
            payload = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            client.transport.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool.drop(self)
        client, self.client = self.client, None
        if client is not None:
            client.upstream_gone()


class Pool:
    """Idle upstream connections, at most ``size`` (nginx's ``keepalive``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, size: int) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.size = size
        self.idle: list[ParsedUpstream] = []

    def put(self, upstream: ParsedUpstream) -> None:
        import httptools

        if len(self.idle) < self.size and upstream.transport is not None:
            upstream.parser = httptools.HttpResponseParser(upstream)
            self.idle.append(upstream)
        elif upstream.transport is not None:
            upstream.transport.close()

    def drop(self, upstream: ParsedUpstream) -> None:
        if upstream in self.idle:
            self.idle.remove(upstream)


class Client(asyncio.Protocol):
    """One client connection: its bytes go to the upstream as they come."""

    __slots__ = ("_pending", "factory", "transport", "upstream")

    def __init__(self, factory: Floor) -> None:
        self.factory = factory
        self.transport: Any = None
        self.upstream: Any = None
        #: Bytes the client sent before the upstream connection was up.
        self._pending: list[bytes] | None = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.factory.loop.create_task(self._connect())

    async def _connect(self) -> None:
        floor = self.factory
        try:
            upstream = await floor.upstream_for(self)
        except OSError:
            self.transport.close()
            return
        if self.transport.is_closing():
            upstream.transport.close()
            return
        self.upstream = upstream
        pending, self._pending = self._pending, None
        if pending:
            upstream.transport.write(b"".join(pending))

    def data_received(self, data: bytes) -> None:
        upstream = self.upstream
        if upstream is not None:
            upstream.transport.write(data)
        elif self._pending is not None:
            self._pending.append(data)

    def pause_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None:
            self.upstream.transport.resume_reading()

    def upstream_gone(self) -> None:
        self.upstream = None
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.client = None
            upstream.transport.close()


class Floor:
    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int, parsed: bool) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.pool = Pool(loop, host, port, 256) if parsed else None

    async def upstream_for(self, client: Client) -> Any:
        pool = self.pool
        if pool is not None:
            if pool.idle:
                upstream = pool.idle.pop()
            else:
                _, upstream = await self.loop.create_connection(
                    lambda: ParsedUpstream(pool), self.host, self.port
                )
            upstream.client = client
            return upstream
        kind = BurningUpstream if BurningUpstream.burn else Upstream
        _, raw = await self.loop.create_connection(lambda: kind(client), self.host, self.port)
        return raw


async def serve(listen: tuple[str, int], upstream: tuple[str, int], parsed: bool) -> None:
    loop = asyncio.get_running_loop()
    floor = Floor(loop, upstream[0], upstream[1], parsed)
    server = await loop.create_server(
        lambda: Client(floor), listen[0], listen[1], backlog=4096, reuse_address=True
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor")
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    parser.add_argument("--upstream", required=True, help="HOST:PORT")
    parser.add_argument("--httptools", action="store_true", help="parse the response")
    parser.add_argument("--burn-us", type=float, default=0.0, help="busy Python per read (raw)")
    args = parser.parse_args(argv)
    BurningUpstream.burn = args.burn_us / 1e6
    procfs.raise_fd_limit()
    procfs.run(serve(_address(args.listen), _address(args.upstream), args.httptools))
    return 0


if __name__ == "__main__":
    sys.exit(main())
