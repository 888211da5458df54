"""An aiohttp app served on a free loopback port, as a test's upstream (or receiver)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
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
