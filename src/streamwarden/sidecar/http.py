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
  to judge, and it streams through;
- past ``max_client_connections`` open connections, a new one is answered
  503 and closed the moment it is accepted, before a byte of it is parsed:
  a flood of idle connections must not take the descriptors that the admin
  port, the upstreams and the clients already served need (see
  :mod:`streamwarden.sidecar.descriptors`). A stream read on after its
  client left holds a place of its own (:class:`ClientConnections`).

What the stream driver needs from each client connection, and aiohttp does
not expose, is :class:`ClientChannel`: a callback the moment the client
leaves (so the upstream hears of it first), whether the client's transport
is over its high-water mark, and a way to wait until it is not.

aiohttp offers no hook for any of these, so this module subclasses its
per-connection ``RequestHandler``, and :class:`GuardedServer` (aiohttp's
low-level ``Server``, which the proxy runs on) builds those. It relies on
three attributes of ``RequestHandler`` (the count of parsed requests, the
request being handled, and the queue of parsed requests, which it makes a
list: see :class:`_ShortDeque`, as it does the read buffer of a request body
read to its end), all present since aiohttp 3.8, on the request's cache of
its properties (:func:`travel_light`) and on
its protocol's ``_drain_helper``; the tests in ``tests/sidecar/test_hostile_input.py``
and ``tests/sidecar/test_faults.py`` fail loudly if they change.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import ClientConnectionResetError, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

from streamwarden.core.refusals import RefusalKind
from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.sidecar.channel import ClientChannel

__all__ = [
    "CLIENT_GONE",
    "ClientChannel",
    "ClientConnections",
    "GuardedServer",
    "client_channel",
    "refuse",
    "travel_light",
]

#: How a write to a client that has gone surfaces.
CLIENT_GONE = (ConnectionResetError, BrokenPipeError, ClientConnectionResetError)

log = logging.getLogger("streamwarden.proxy")

#: Called with the reason of every connection the listener refuses itself.
RefusalCounter = Callable[[str], None]


class _ShortDeque(list[Any]):
    """One of aiohttp's deques that holds one item or none, as a list.

    A ``deque``'s first block alone is 0.6 KiB, and aiohttp keeps two for
    as long as a stream is open: its connection's queue of parsed requests
    (one at a time, a few when a client pipelines, bounded by aiohttp) and
    the request body's read buffer (empty once the body is read).
    """

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


def travel_light(request: web.BaseRequest) -> None:
    """A stream's head is out: what its request holds for nothing any more goes.

    aiohttp caches every request property it computed (a dozen by now,
    0.5 KiB with the dict) for the request's life, which for a stream is
    the stream's; they are computed again if asked for. And once the
    request's body is read to its end, its reader's deque goes (above).
    """
    request._cache.clear()
    reader = request.content
    # Not aiohttp's one shared reader of requests without a body (another class).
    if type(reader) is StreamReader and reader.is_eof() and not reader._buffer:
        reader._buffer = _ShortDeque()  # type: ignore[assignment]


class ClientConnections:
    """The proxy port's places under ``max_client_connections``, and who holds them.

    A client connection holds a place; so does a stream read on after its
    client left (``on_client_gone: drain`` or ``detach``), until it ends:
    it keeps its upstream connection open, and the budget the limit is
    derived from counts every place as a client with its upstream. Without
    that, a client that opens a stream and leaves, again and again, would
    pile up upstream connections (and generations) past any limit.
    """

    __slots__ = ("limit", "open", "read_on", "refusal")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Client connections open on the proxy port.
        self.open = 0
        #: Streams read on in the background after their client left.
        self.read_on = 0
        #: The whole answer to a connection past the limit, written as it is accepted.
        self.refusal = _raw_response(RefusalKind.TOO_MANY_CONNECTIONS, limit=limit)

    @property
    def held(self) -> int:
        """Places held: client connections and streams read on without one."""
        return self.open + self.read_on

    def hold_for_read_on(self) -> Callable[[], None]:
        """A stream runs on without its client: it holds a place until the returned call."""
        self.read_on += 1
        held = True

        def give_back() -> None:
            nonlocal held
            if held:
                held = False
                self.read_on -= 1

        return give_back


class _GuardedRequestHandler(RequestHandler):
    __slots__ = (
        "_connections",
        "_counted",
        "_header_deadline",
        "_header_timer",
        "_on_refused",
        "_requests_at_arm",
        "_warnings",
        "on_client_gone",
    )

    def __init__(
        self,
        *args: Any,
        header_deadline: float,
        on_refused: RefusalCounter | None,
        warnings: RateLimitedWarnings,
        connections: ClientConnections,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._messages = _ShortDeque()  # type: ignore[assignment]
        self._connections = connections
        #: Whether this connection holds one of ``connections``' places.
        self._counted = False
        self._on_refused = on_refused
        self._warnings = warnings
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
        connections = self._connections
        if connections.open + connections.read_on >= connections.limit:
            self._refuse_connection(transport)
            return
        connections.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm()

    def _refuse_connection(self, transport: asyncio.BaseTransport) -> None:
        """Answer 503 and close, never handing the connection to aiohttp (nothing is read)."""
        self._refused("too_many_connections")
        self._warnings.warn(
            "too_many_connections",
            "max_client_connections (%d) reached: new client connections get 503 and are closed",
            self._connections.limit,
        )
        # A stream transport (uvloop's is one without subclassing asyncio's).
        writable = cast(asyncio.Transport, transport)
        writable.write(self._connections.refusal)
        writable.close()

    def data_received(self, data: bytes) -> None:
        before = self._request_count
        super().data_received(data)
        if self._request_count != before:
            self._disarm()  # a whole header block arrived
        elif self._current_request is None and self._header_timer is None:
            self._arm()  # the start of a new request on a kept-alive connection

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return  # refused: aiohttp never had it
        self._counted = False
        self._connections.open -= 1
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
        self._refused("header_timeout")
        self._warnings.warn(
            "header_timeout",
            "request headers not complete after %gs: closing",
            self._header_deadline,
        )
        transport.write(
            b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        transport.close()

    def _refused(self, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)

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
        self._refused(_REFUSAL_LABELS.get(reason, "malformed"))
        # One line, no request bytes: they may carry credentials.
        self._warnings.warn(
            reason, "refused a malformed request from %s: %s", request.remote, reason
        )
        response = web.Response(status=status, text=f"{status} {reason}\n")
        response.force_close()
        return response


def client_channel(request: web.BaseRequest, response: web.StreamResponse) -> ClientChannel:
    """The client's side of ``response``, once its head is sent (see :class:`ClientChannel`)."""
    protocol = request.protocol
    transport = request.transport
    if not isinstance(protocol, _GuardedRequestHandler) or transport is None:
        raise RuntimeError("the proxy runs only behind GuardedServer's connections")
    chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
    return ClientChannel(protocol, transport, chunked)


# The metric label of each refusal reason (a small fixed set).
_REFUSAL_LABELS = {
    "request header too long": "header_too_long",
    "too many request headers": "too_many_headers",
    "request line too long": "request_line_too_long",
    "malformed request": "malformed",
}

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


_SHARED_WARNINGS = RateLimitedWarnings()


class GuardedServer(web.Server):
    """aiohttp's low-level server, whose connections refuse precisely and time out slow headers.

    The proxy has one handler for every target, so it needs neither aiohttp's
    router nor its middleware chain: each is a coroutine frame more in every
    open stream, and a route match per request.
    """

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *,
        header_deadline: float,
        connections: ClientConnections,
        on_refused: RefusalCounter | None = None,
        warnings: RateLimitedWarnings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        #: Not aiohttp's ``connections`` (its list of handlers): the count and its limit.
        self.client_connections = connections
        self._header_deadline = header_deadline
        self._on_refused = on_refused
        self._warnings = warnings or _SHARED_WARNINGS

    def __call__(self) -> RequestHandler:
        return _GuardedRequestHandler(
            self,
            loop=self._loop,
            header_deadline=self._header_deadline,
            on_refused=self._on_refused,
            warnings=self._warnings,
            connections=self.client_connections,
            **self._kwargs,
        )


def _check_aiohttp() -> None:
    """Fail at import, with the names, if this aiohttp lacks what the module relies on.

    A changed private name would otherwise surface as a stream that never
    hears its client leave, or a slowloris that is never cut: silently.
    """
    slots = set(getattr(RequestHandler, "__slots__", ()))
    missing = [
        name
        # _parser: the request parser, whose state says where a refusal hit (3.14 on).
        for name in ("_request_count", "_current_request", "_messages", "_paused", "_parser")
        if name not in slots and name not in getattr(BaseProtocol, "__slots__", ())
    ]
    missing += [
        f"RequestHandler.{name}"
        for name in ("_drain_helper", "writing_paused", "eof_received", "handle_error")
        if not hasattr(RequestHandler, name)
    ]
    if "_buffer" not in set(getattr(StreamReader, "__slots__", ())):
        missing.append("StreamReader._buffer")
    if "_cache" not in getattr(web.BaseRequest, "ATTRS", ()):
        missing.append("BaseRequest._cache")
    # GuardedServer builds each connection's handler from what Server.__init__ kept.
    kept = web.Server.__init__.__code__.co_names
    missing += [f"Server.{name}" for name in ("_kwargs", "_loop") if name not in kept]
    if missing:
        import aiohttp

        raise ImportError(
            f"streamwarden.sidecar needs aiohttp internals missing from aiohttp "
            f"{aiohttp.__version__}: {', '.join(missing)} (tested: {_tested_aiohttp()})"
        )


def _tested_aiohttp() -> str:
    """The aiohttp range this install declares (pyproject.toml's, the one place it is kept)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        declared = requires("streamwarden") or []
    except PackageNotFoundError:
        return "see pyproject.toml"
    return next((r.removeprefix("aiohttp") for r in declared if r.startswith("aiohttp")), "?")


_check_aiohttp()


def _raw_response(kind: RefusalKind, **values: object) -> bytes:
    """A refusal's whole HTTP/1.1 response, for a connection no request was read from."""
    refusal = kind.refusal
    body = refusal.body(**values)
    head = [
        f"HTTP/1.1 {refusal.status} {HTTPStatus(refusal.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in refusal.headers),
        "Connection: close",
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def refuse(kind: RefusalKind, **values: object) -> web.Response:
    """The response of a refusal the sidecar answers itself (the table is in refusals)."""
    refusal = kind.refusal
    response = web.Response(
        body=refusal.body(**values), status=refusal.status, content_type="application/json"
    )
    for name, value in refusal.headers:
        response.headers[name] = value
    return response
