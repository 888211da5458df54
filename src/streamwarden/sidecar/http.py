"""The proxy listener's HTTP connections: precise refusals, a header deadline, and hooks.

aiohttp answers every malformed request with a 400 and logs the offending
bytes (which can hold a bearer token) with a traceback. A proxy owes its
clients and operators better:

- a request line over ``max_request_line_bytes`` gets 414, a header line
  over ``max_header_bytes`` or more than ``max_headers`` headers get 431,
  and the log line names only the client and the reason;
- a client that trickles its request headers (slowloris) is cut with a 408
  after ``request_header_timeout``, so it cannot hold a connection and its
  memory forever. Bodies are not affected: a slow upload is the upstream's
  to judge, and it streams through.

Two more things the proxy needs from each connection and aiohttp does not
expose: a callback the moment the client leaves (:func:`on_client_gone`,
so the upstream hears of it first), and whether the client's transport is
over its high-water mark, with a way to wait until it is not
(:func:`writing_paused`, :func:`wait_writable`; the relay in
``sidecar/direct.py`` writes to the transport itself).

aiohttp offers no hook for any of these, so this module subclasses its
per-connection ``RequestHandler`` and makes the runner's ``Server`` build
those. It relies on two attributes of ``RequestHandler`` (the count of
parsed requests and the request being handled), both present since aiohttp
3.8, and on its protocol's ``_drain_helper``; the tests in
``tests/test_hostile_input.py`` and ``tests/test_faults.py`` fail loudly if
they change.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable
from typing import Any

from aiohttp import ClientConnectionResetError, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

__all__ = ["CLIENT_GONE", "GuardedAppRunner", "on_client_gone", "wait_writable", "writing_paused"]

#: How a write to a client that has gone surfaces.
CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ClientConnectionResetError)

log = logging.getLogger("streamwarden.proxy")


class _GuardedRequestHandler(RequestHandler):
    __slots__ = ("_header_deadline", "_header_timer", "_requests_at_arm", "on_client_gone")

    def __init__(self, *args: Any, header_deadline: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline = header_deadline
        self._header_timer: asyncio.TimerHandle | None = None
        self._requests_at_arm = 0
        #: Called once, in the very callback that hears the client leave (see
        #: :func:`on_client_gone`).
        self.on_client_gone: Callable[[], object] | None = None

    def eof_received(self) -> None:
        # aiohttp closes the connection on a client's FIN, as on a reset.
        self._client_gone()
        super().eof_received()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._disarm()  # a whole header block arrived
        elif self._current_request is None and self._header_timer is None:
            self._arm()  # the start of a new request on a kept-alive connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._client_gone()
        super().connection_lost(exc)

    def _client_gone(self) -> None:
        callback, self.on_client_gone = self.on_client_gone, None
        if callback is not None:
            callback()

    def _arm(self) -> None:
        if self._header_deadline > 0:
            self._requests_at_arm = self._request_count
            self._header_timer = asyncio.get_running_loop().call_later(
                self._header_deadline, self._headers_too_slow
            )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._request_count != self._requests_at_arm or self._current_request is not None:
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        log.warning("request headers not complete after %gs: closing", self._header_deadline)
        transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        transport.close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, BadHttpMessage):
            return super().handle_error(request, status, exc, message)
        # The pure-Python parser keeps the lines it has read: past the first,
        # it was reading headers.
        in_headers = bool(getattr(self._parser, "_lines", None))
        status, reason = _refusal(exc, in_headers)
        # One line, no request bytes: they may carry credentials.
        log.warning("refused a malformed request from %s: %s", request.remote, reason)
        response = web.Response(status=status, text=f"{status} {reason}\n")
        response.force_close()
        return response


def on_client_gone(request: web.BaseRequest, callback: Callable[[], object] | None) -> None:
    """Run ``callback`` the moment ``request``'s client closes its connection (``None``: stop).

    aiohttp answers a client that leaves by cancelling the request's
    handler; the cancellation reaches the code that closes the upstream
    three or four event-loop turns later, with the coroutine stack to
    unwind between. A callback here runs in the callback that read the
    client's FIN or reset, so the upstream can be told first (the handler
    still runs its cleanup as before). Requests served by other handlers
    (tests that build a plain aiohttp app) just do without.
    """
    protocol = request.protocol
    if isinstance(protocol, _GuardedRequestHandler):
        protocol.on_client_gone = callback


def writing_paused(request: web.BaseRequest) -> bool | None:
    """Whether the client's transport is over its high-water mark (``None``: cannot tell)."""
    protocol = request.protocol
    return protocol.writing_paused if isinstance(protocol, _GuardedRequestHandler) else None


async def wait_writable(request: web.BaseRequest) -> None:
    """Until the client's transport is back under its low-water mark.

    Raises ``ClientConnectionResetError`` if the client is gone. (The
    protocol's drain is what ``StreamResponse.write`` awaits, without a
    public name of its own.)
    """
    protocol = request.protocol
    if isinstance(protocol, _GuardedRequestHandler):
        await protocol._drain_helper()


_HEADER_PARSING = ("cb_on_header_field", "cb_on_header_value")


def _refusal(exc: BadHttpMessage, in_headers: bool) -> tuple[int, str]:
    """The status and reason for a request the parser rejected."""
    if isinstance(exc, LineTooLong):
        # Which part of the request was too long is only told by where the
        # parser stopped: in a header callback (C parser) or past the first
        # line (pure-Python parser), else on the request line.
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]
        if in_headers or any(name.endswith(_HEADER_PARSING) for name in frames):
            return 431, "request header too long"
        return 414, "request line too long"
    if "Too many headers" in str(exc):
        return 431, "too many request headers"
    return 400, "malformed request"


class _GuardedServer(web.Server):
    def __call__(self) -> RequestHandler:
        kwargs = dict(self._kwargs)
        deadline = float(kwargs.pop("header_deadline", 0.0))
        return _GuardedRequestHandler(self, loop=self._loop, header_deadline=deadline, **kwargs)


class GuardedAppRunner(web.AppRunner):
    """An ``AppRunner`` whose connections refuse precisely and time out slow headers."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        return server
