"""WebSocket upgrades, relayed both ways on aiohttp's client and server.

A WebSocket is not a token stream the relay understands: messages are
copied as they are, in both directions, and a close on either side is
passed on to the other with its code. This stays on aiohttp's WebSocket
client (the stream path has the sidecar's own HTTP client); it opens its
connections apart from the stream pool.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from streamwarden.refusals import RefusalKind

__all__ = ["WebSocketRelay", "is_websocket"]

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


def is_websocket(request: web.Request) -> bool:
    upgrade = request.headers.get("Upgrade", "").lower()
    connection = request.headers.get("Connection", "").lower()
    return upgrade == "websocket" and "upgrade" in connection


class WebSocketRelay:
    """Relays WebSocket sessions to the upstream; one per process."""

    def __init__(self, connector: aiohttp.BaseConnector) -> None:
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        await self._session.close()

    async def relay(
        self, request: web.Request, url: URL, headers: CIMultiDict[str]
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
                url, headers=headers, protocols=protocols, autoclose=False, autoping=True
            )
        except aiohttp.WSServerHandshakeError as exc:
            refused = RefusalKind.WEBSOCKET_REFUSED.refusal
            return web.Response(
                body=refused.body(),
                status=exc.status or refused.status,
                content_type="application/json",
            )
        except (aiohttp.ClientError, OSError, TimeoutError):
            unreachable = RefusalKind.UPSTREAM_UNREACHABLE.refusal
            return web.Response(
                body=unreachable.body(), status=unreachable.status, content_type="application/json"
            )
        client = web.WebSocketResponse(
            protocols=(upstream.protocol,) if upstream.protocol else (), autoclose=False
        )
        try:
            await client.prepare(request)
            await _splice(client, upstream)
        finally:
            await upstream.close()
            if not client.closed:
                await client.close(code=aiohttp.WSCloseCode.GOING_AWAY)
        return client


async def _splice(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Copy messages both ways until one side closes, then close the other with its code.

    Only the pumps ever call ``receive``: the pump that did not see the close
    is cancelled before anyone calls ``close``, so no socket is read by two
    coroutines at once.
    """
    sides: dict[asyncio.Future[tuple[int, str]], tuple[Any, Any]] = {
        asyncio.ensure_future(_pump(client, upstream)): (client, upstream),
        asyncio.ensure_future(_pump(upstream, client)): (upstream, client),
    }
    try:
        done, _ = await asyncio.wait(sides, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in sides:
            task.cancel()
        await asyncio.gather(*sides, return_exceptions=True)
    first = done.pop()
    source, sink = sides[first]
    code: int = aiohttp.WSCloseCode.GOING_AWAY
    reason = ""
    if not first.cancelled() and first.exception() is None:
        code, reason = first.result()
    if not sink.closed:
        await sink.close(code=code, message=reason.encode())
    if not source.closed:
        await source.close(code=code, message=reason.encode())


async def _pump(source: Any, sink: Any) -> tuple[int, str]:
    """Forward messages until ``source`` closes; return its close code and reason."""
    while True:
        message = await source.receive()
        if message.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type == aiohttp.WSMsgType.CLOSE:
            code = message.data
            if not isinstance(code, int) or code in _RESERVED_CLOSE_CODES:
                code = aiohttp.WSCloseCode.GOING_AWAY
            return code, message.extra or ""
        elif message.type not in (aiohttp.WSMsgType.PING, aiohttp.WSMsgType.PONG):
            # CLOSING, CLOSED, ERROR: the peer vanished without a close frame.
            return aiohttp.WSCloseCode.GOING_AWAY, ""
