"""A test's upstream on a free loopback port: an aiohttp app (or receiver), or a raw TCP server.

A raw upstream (:func:`raw_upstream`) writes whatever bytes its handler
writes, for what no HTTP server library would send: a response split at a
chosen byte, an unsolicited second response, a malformed head.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

#: ``start(app, **runner_options)``: the app on a free loopback port, its base URL;
#: stopped after the test. The type a test takes its ``serve_upstream`` fixture as.
ServeUpstream = Callable[..., Awaitable[str]]


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, *, ssl_context: ssl.SSLContext | None = None, **runner_options: Any
) -> AsyncIterator[str]:
    """``app`` on a free loopback port: its base URL, ``http(s)://127.0.0.1:<port>``.

    ``runner_options`` go to :class:`aiohttp.web.AppRunner` (``handler_cancellation``,
    ``shutdown_timeout``, ``access_log``...); ``ssl_context`` makes the site HTTPS.
    """
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
        scheme = "http" if ssl_context is None else "https"
        yield f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def port_of(url: str) -> int:
    """The port of a base URL from :func:`serving`, for tests that open sockets themselves."""
    return int(url.rsplit(":", 1)[1])


# -- a raw TCP upstream ---------------------------------------------------------------

#: Serves one connection: reads the request, writes the response, byte by byte as it likes.
RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawUpstream:
    """A raw TCP server: every connection runs ``handler``; counts connections."""

    port: int
    connections: int = 0
    server: asyncio.Server | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def raw_upstream(handler: RawHandler) -> AsyncIterator[RawUpstream]:
    """A raw TCP server on a free loopback port, ``handler`` run for each connection.

    A handler's connection errors end only its connection; on exit the server
    closes and the handlers still running are cancelled.
    """
    upstream = RawUpstream(0)
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream.connections += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            tasks.discard(task)
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    upstream.server = server
    upstream.port = server.sockets[0].getsockname()[1]
    try:
        yield upstream
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request's head and its ``Content-Length`` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return head, body
