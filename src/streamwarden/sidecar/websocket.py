"""WebSocket upgrades, relayed both ways on aiohttp's client and server.

A WebSocket is not a token stream the relay understands: messages are
copied as they are, in both directions, and a close on either side is
passed on to the other with its code. This stays on aiohttp's WebSocket
client (the stream path has the sidecar's own HTTP client); it opens its
connections apart from the stream pool.

Idle WebSockets are cut by load balancers and corporate proxies after 60 to
120 s, as idle streams are. Each side that has been quiet for
``keepalive_interval`` gets a ping (pings are hop-by-hop: each side's are
answered here, not relayed); a side that then stays silent for another
interval, pong included, is closed with 1011 and the other side with 1001.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from streamwarden.core.refusals import RefusalKind

__all__ = ["SessionEnd", "WebSocketRelay", "is_websocket"]

# The handshake headers are the upstream client's to generate.
_HANDSHAKE = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
    }
)
# Close codes that may not be sent on the wire (RFC 6455 section 7.4.1).
_RESERVED_CLOSE_CODES = (1005, 1006, 1015)


def is_websocket(request: web.BaseRequest) -> bool:
    upgrade = request.headers.get("Upgrade", "").lower()
    connection = request.headers.get("Connection", "").lower()
    return upgrade == "websocket" and "upgrade" in connection


class SessionEnd(enum.StrEnum):
    """How a relayed WebSocket session ended (the metrics label)."""

    CLIENT_CLOSED = "client_closed"
    UPSTREAM_CLOSED = "upstream_closed"
    CLIENT_PING_TIMEOUT = "client_ping_timeout"
    UPSTREAM_PING_TIMEOUT = "upstream_ping_timeout"
    REFUSED = "refused"


#: Told when a session starts (``None``) and how it ended.
SessionListener = Callable[[SessionEnd | None], None]

# The code a side that stopped answering pings is closed with.
_PING_TIMEOUT_CODE = 1011


class _Side:
    """One end of a relayed session, and when it was last heard from."""

    __slots__ = ("heard", "name", "ws")

    def __init__(self, name: str, ws: Any) -> None:
        self.name = name
        self.ws = ws
        self.heard = asyncio.get_running_loop().time()


class WebSocketRelay:
    """Relays WebSocket sessions to the upstream; one per process."""

    def __init__(
        self,
        connector: aiohttp.BaseConnector,
        keepalive_interval: float,
        listener: SessionListener | None = None,
    ) -> None:
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._keepalive = keepalive_interval
        self._listener = listener

    def _tell(self, end: SessionEnd | None) -> None:
        if self._listener is not None:
            self._listener(end)

    async def close(self) -> None:
        await self._session.close()

    async def relay(
        self, request: web.BaseRequest, url: URL, headers: CIMultiDict[str]
    ) -> web.StreamResponse:
        for name in list(headers):
            if name.lower() in _HANDSHAKE:
                headers.popall(name, None)
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        ]
        try:
            upstream = await self._session.ws_connect(
                url, headers=headers, protocols=protocols, autoclose=False, autoping=False
            )
        except aiohttp.WSServerHandshakeError as exc:
            self._tell(SessionEnd.REFUSED)
            refused = RefusalKind.WEBSOCKET_REFUSED.refusal
            return web.Response(
                body=refused.body(),
                status=exc.status or refused.status,
                content_type="application/json",
            )
        except (aiohttp.ClientError, OSError, TimeoutError):
            self._tell(SessionEnd.REFUSED)
            unreachable = RefusalKind.UPSTREAM_UNREACHABLE.refusal
            return web.Response(
                body=unreachable.body(), status=unreachable.status, content_type="application/json"
            )
        client = web.WebSocketResponse(
            protocols=(upstream.protocol,) if upstream.protocol else (),
            autoclose=False,
            autoping=False,
        )
        self._tell(None)
        end = SessionEnd.CLIENT_CLOSED
        try:
            await client.prepare(request)
            end = await self._splice(_Side("client", client), _Side("upstream", upstream))
        finally:
            await upstream.close()
            if not client.closed:
                await client.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            self._tell(end)
        return client

    async def _splice(self, client: _Side, upstream: _Side) -> SessionEnd:
        """Copy messages both ways until one side closes or goes silent; close the other.

        Only the pumps ever call ``receive``: the pump that did not see the
        close is cancelled before anyone calls ``close``, so no socket is
        read by two coroutines at once.
        """
        tasks: dict[asyncio.Future[tuple[int, str]], tuple[_Side, _Side]] = {
            asyncio.ensure_future(_pump(client, upstream)): (client, upstream),
            asyncio.ensure_future(_pump(upstream, client)): (upstream, client),
        }
        watchers: dict[asyncio.Future[None], _Side] = {}
        if self._keepalive > 0:
            for side in (client, upstream):
                watchers[asyncio.ensure_future(_keep_alive(side, self._keepalive))] = side
        everything: list[asyncio.Future[Any]] = [*tasks, *watchers]
        try:
            done, _ = await asyncio.wait(everything, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in everything:
                task.cancel()
            await asyncio.gather(*everything, return_exceptions=True)
        first = done.pop()
        silent = watchers.get(first)
        if silent is not None:
            other = upstream if silent is client else client
            await _close(silent, _PING_TIMEOUT_CODE, "ping timeout")
            await _close(other, aiohttp.WSCloseCode.GOING_AWAY, "peer timed out")
            if silent is client:
                return SessionEnd.CLIENT_PING_TIMEOUT
            return SessionEnd.UPSTREAM_PING_TIMEOUT
        source, sink = tasks[first]
        code: int = aiohttp.WSCloseCode.GOING_AWAY
        reason = ""
        if not first.cancelled() and first.exception() is None:
            code, reason = first.result()
        await _close(sink, code, reason)
        await _close(source, code, reason)
        return SessionEnd.CLIENT_CLOSED if source is client else SessionEnd.UPSTREAM_CLOSED


async def _close(side: _Side, code: int, reason: str) -> None:
    if not side.ws.closed:
        await side.ws.close(code=code, message=reason.encode())


async def _keep_alive(side: _Side, interval: float) -> None:
    """Ping a side quiet for ``interval``; return if it then stays silent as long."""
    loop = asyncio.get_running_loop()
    while True:
        quiet = loop.time() - side.heard
        if quiet < interval:
            await asyncio.sleep(interval - quiet)
            continue
        pinged = loop.time()
        await side.ws.ping()
        await asyncio.sleep(interval)
        if side.heard < pinged:
            return  # neither a pong nor anything else: gone


async def _pump(source: _Side, sink: _Side) -> tuple[int, str]:
    """Forward messages until ``source`` closes; return its close code and reason."""
    loop = asyncio.get_running_loop()
    while True:
        message = await source.ws.receive()
        source.heard = loop.time()
        kind = message.type
        if kind == aiohttp.WSMsgType.TEXT:
            await sink.ws.send_str(message.data)
        elif kind == aiohttp.WSMsgType.BINARY:
            await sink.ws.send_bytes(message.data)
        elif kind == aiohttp.WSMsgType.PING:
            await source.ws.pong(message.data)  # hop-by-hop: answered here
        elif kind == aiohttp.WSMsgType.PONG:
            continue
        elif kind == aiohttp.WSMsgType.CLOSE:
            code = message.data
            if not isinstance(code, int) or code in _RESERVED_CLOSE_CODES:
                code = aiohttp.WSCloseCode.GOING_AWAY
            return code, message.extra or ""
        else:
            # CLOSING, CLOSED, ERROR: the peer vanished without a close frame.
            return aiohttp.WSCloseCode.GOING_AWAY, ""
