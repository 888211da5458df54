"""WebSocket upgrades, relayed both ways on aiohttp's client and server.

A WebSocket is not a token stream the relay understands: messages are
copied as they are, in both directions, and a close on either side is
passed on to the other with its code. This stays on aiohttp's WebSocket
client (the stream path has the sidecar's own HTTP client); it opens its
connections apart from the stream pool.

A WebSocket that carries streams (the Responses API's, on ``/responses``:
:func:`~streamwarden.core.messages.carries_streams`) is read as well: each
``response.create`` is a stream through the pipeline (metered, limited,
checked, filtered, traced, recorded like an HTTP stream, and holding one
of ``max_concurrent_streams``: past it, that ``response.create`` is
answered with an ``error`` message and goes nowhere, the session goes on),
its messages go on as they came (or as its output filters let them out),
and a stream cut (the upstream closing mid-response, even with 1000, or
vanishing, a limit, a broken tool call) reaches the client as an ``error``
message and a 1011 close, which the openai SDK raises on. What each
message means is :class:`~streamwarden.core.messages.MessageSession`'s to
say; this module only moves messages and time.

Idle WebSockets are cut by load balancers and corporate proxies after 60 to
120 s, as idle streams are. Each side that has been quiet for
``keepalive_interval`` gets a ping (pings are hop-by-hop: each side's are
answered here, not relayed); a side that then stays silent for another
interval, pong included, is closed with 1011 and the other side with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from streamwarden.config import ResolvedRoute
from streamwarden.core.messages import (
    CUT_CLOSE_CODE,
    MessageSession,
    Reply,
    carries_streams,
)
from streamwarden.core.refusals import RefusalKind
from streamwarden.core.relay import Relay
from streamwarden.pipeline import PipelineStream, StreamStart
from streamwarden.pipeline.step import SessionSlots
from streamwarden.sidecar.forwarding import describe
from streamwarden.sidecar.streaming import Streaming
from streamwarden.sidecar.streams import ActiveStream

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
    #: A stream the session carried was cut: an ``error`` message, then 1011.
    STREAM_CUT = "stream_cut"


#: Told when a session starts (``None``) and how it ended.
SessionListener = Callable[[SessionEnd | None], None]

# aiohttp's own bound on a message, kept for a plain splice.
_SPLICE_MAX_MESSAGE = 4 * 1024 * 1024
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
        streaming: Streaming | None = None,
    ) -> None:
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._keepalive = keepalive_interval
        self._listener = listener
        #: Where the streams a session carries are opened and recorded (``None``: none read).
        self._streaming = streaming

    def _tell(self, end: SessionEnd | None) -> None:
        if self._listener is not None:
            self._listener(end)

    async def close(self) -> None:
        await self._session.close()

    async def relay(
        self,
        request: web.BaseRequest,
        url: URL,
        headers: CIMultiDict[str],
        route: ResolvedRoute | None = None,
    ) -> web.StreamResponse:
        for name in list(headers):
            if name.lower() in _HANDSHAKE:
                headers.popall(name, None)
        protocols = [
            p.strip()
            for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
            if p.strip()
        ]
        streams: _SessionStreams | None = None
        max_msg_size = _SPLICE_MAX_MESSAGE
        streaming = self._streaming
        if streaming and route and carries_streams(route.dialect, request.path):
            streams = _SessionStreams(streaming, request, route)
            # aiohttp reads no message past this: the stream's event bound.
            max_msg_size = route.limits.max_event_bytes
        try:
            upstream = await self._session.ws_connect(
                url,
                headers=headers,
                protocols=protocols,
                autoclose=False,
                autoping=False,
                max_msg_size=max_msg_size,
            )
        except aiohttp.WSServerHandshakeError as exc:
            return self._refused(RefusalKind.WEBSOCKET_REFUSED, exc.status)
        except (aiohttp.ClientError, OSError, TimeoutError):
            return self._refused(RefusalKind.UPSTREAM_UNREACHABLE)
        client = web.WebSocketResponse(
            protocols=(upstream.protocol,) if upstream.protocol else (),
            autoclose=False,
            autoping=False,
        )
        self._tell(None)
        end = SessionEnd.CLIENT_CLOSED
        try:
            await client.prepare(request)
            sides = _Side("client", client), _Side("upstream", upstream)
            if streams is None:
                end = await self._splice(*sides)
            else:
                end = await self._carry(*sides, streams)
        finally:
            await upstream.close()
            if not client.closed:
                await client.close(code=aiohttp.WSCloseCode.GOING_AWAY)
            if streams is not None:
                streams.session.end(asyncio.get_running_loop().time())
                streams.release()
            self._tell(end)
        return client

    def _refused(self, kind: RefusalKind, status: int | None = None) -> web.Response:
        self._tell(SessionEnd.REFUSED)
        refused = kind.refusal
        return web.Response(
            body=refused.body(), status=status or refused.status, content_type="application/json"
        )

    async def _race(
        self, client: _Side, upstream: _Side, tasks: list[asyncio.Future[_Ended]]
    ) -> tuple[asyncio.Future[Any], _Side | None]:
        """Run ``tasks`` and the keep-alive watchers until one ends; the first, and the side
        that went silent if it was a watcher. Every other is cancelled before it returns."""
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
        return first, watchers.get(first)

    async def _splice(self, client: _Side, upstream: _Side) -> SessionEnd:
        """Copy messages both ways until one side closes or goes silent; close the other.

        Only the pumps ever call ``receive``: the pump that did not see the
        close is cancelled before anyone calls ``close``, so no socket is
        read by two coroutines at once.
        """
        tasks: dict[asyncio.Future[_Ended], tuple[_Side, _Side]] = {
            asyncio.ensure_future(_pump(client, upstream)): (client, upstream),
            asyncio.ensure_future(_pump(upstream, client)): (upstream, client),
        }
        first, silent = await self._race(client, upstream, list(tasks))
        if silent is not None:
            other = upstream if silent is client else client
            await _close(silent, _PING_TIMEOUT_CODE, "ping timeout")
            await _close(other, aiohttp.WSCloseCode.GOING_AWAY, "peer timed out")
            if silent is client:
                return SessionEnd.CLIENT_PING_TIMEOUT
            return SessionEnd.UPSTREAM_PING_TIMEOUT
        source, sink = tasks[first]
        ended = None if first.cancelled() or first.exception() else first.result()
        code: int = aiohttp.WSCloseCode.GOING_AWAY
        reason = ""
        if ended is not None and ended.code is not None:
            code, reason = ended.code, ended.reason
        elif source is upstream:
            # Vanished without a close frame: directly, the client's abnormal
            # closure (1006); through the relay an error close, never a normal one.
            code, reason = CUT_CLOSE_CODE, "upstream vanished"
        await _close(sink, code, reason)
        await _close(source, code, reason)
        return SessionEnd.CLIENT_CLOSED if source is client else SessionEnd.UPSTREAM_CLOSED

    async def _carry(self, client: _Side, upstream: _Side, streams: _SessionStreams) -> SessionEnd:
        """As :meth:`_splice`, with each message read by the session's streams.

        The client's messages go on as they came (a ``response.create`` opens
        a stream first, so its clock starts before the upstream can answer);
        the upstream's go on unless the session cuts a stream on one. A cut
        (or a timer's: the session's deadline) ends the session: the
        ``error`` message, then the error close, and the upstream closed.
        """
        session = streams.session
        reader = _pump(client, upstream, streams.client_text)
        tasks: dict[asyncio.Future[_Ended], _Side] = {
            asyncio.ensure_future(reader): client,
            asyncio.ensure_future(_pump(upstream, client, streams.upstream_text)): upstream,
            asyncio.ensure_future(streams.watch()): upstream,
        }
        first, silent = await self._race(client, upstream, list(tasks))
        now = asyncio.get_running_loop().time()
        if silent is not None:
            if silent is client:
                session.client_closed(now)
            else:  # gone as if it vanished: a response it left open was cut
                await _send_error(client, session, session.upstream_closed(None, now).error)
            await _close(silent, _PING_TIMEOUT_CODE, "ping timeout")
            await _close(upstream if silent is client else client, CUT_CLOSE_CODE, "peer timed out")
            if silent is client:
                return SessionEnd.CLIENT_PING_TIMEOUT
            return SessionEnd.UPSTREAM_PING_TIMEOUT
        ended = _Ended(None) if first.cancelled() or first.exception() else first.result()
        if tasks[first] is client:
            # The client left: its streams end with it, and the upstream is closed
            # at once, so that the model stops generating for nobody.
            session.client_closed(now)
            code = ended.code if ended.code is not None else aiohttp.WSCloseCode.GOING_AWAY
            await _close(upstream, code, ended.reason)
            return SessionEnd.CLIENT_CLOSED
        return await _upstream_ended(client, upstream, session, ended, now)


async def _upstream_ended(
    client: _Side, upstream: _Side, session: MessageSession, ended: _Ended, now: float
) -> SessionEnd:
    """The upstream closed, vanished or cut a stream (a timer too): tell the client, close both.

    A cut reaches the client as its ``error`` message and an error close,
    never as a normal close; a session with no stream open closes as the
    upstream did (vanished: an error close as well).
    """
    error, code, reason = ended.error, ended.code, ended.reason
    if ended.too_large:
        error = session.upstream_too_large(now)
    if error is None:  # closed or vanished: was a stream cut by it?
        closing = session.upstream_closed(code, now)
        error, code = closing.error, closing.code
    if error is not None:
        await _send_error(client, session, error)
        code, reason = CUT_CLOSE_CODE, "stream cut"
    assert code is not None
    await _close(client, code, reason)
    await _close(upstream, code, reason)
    return SessionEnd.STREAM_CUT if error is not None else SessionEnd.UPSTREAM_CLOSED


async def _send_error(client: _Side, session: MessageSession, error: str | None) -> None:
    """A cut's ``error`` message, after what the cut stream's output filters still held."""
    if error is not None:
        with contextlib.suppress(*_GONE):
            for message in session.take_released():
                await client.ws.send_str(message)
            await client.ws.send_str(error)


@dataclass(slots=True)
class _Ended:
    """How a pump ended: the source's close, or a stream cut on one of its messages."""

    #: The source's close code (``None``: it vanished without a close frame).
    code: int | None
    reason: str = ""
    #: A stream was cut: this ``error`` message goes to the client.
    error: str | None = None
    #: The source sent a message past the size the transport reads.
    too_large: bool = False


class _SessionStreams:
    """The streams of one session: its model, and each stream's place in the pipeline."""

    __slots__ = ("_entries", "_request", "_route", "_slots", "_streaming", "_wake", "session")

    def __init__(
        self, streaming: Streaming, request: web.BaseRequest, route: ResolvedRoute
    ) -> None:
        self._streaming = streaming
        self._request = request
        self._route = route
        self._entries: dict[Relay, tuple[ActiveStream, PipelineStream]] = {}
        #: The ``max_concurrent_streams`` places the session's responses hold.
        self._slots = SessionSlots(streaming.pipeline.step, route.dialect, request.path)
        #: Set when the session's deadline may have moved sooner.
        self._wake = asyncio.Event()
        self.session = MessageSession(self._open, self._finish, self._slots.admit)

    def release(self) -> None:
        """The session is over: every place its responses still held goes back."""
        self._slots.release()

    def _open(self, started_at: float, now: float) -> Relay:
        request = self._request
        pipeline = self._streaming.pipeline
        # Each response its own server span (telemetry on), under the handshake's
        # traceparent: the session's own span ends with the session.
        trace = pipeline.step.traced(describe(request, self._route))
        start = StreamStart.of_message("sidecar", self._route, request.path, started_at, now, trace)
        flow = pipeline.open(start)
        entry = ActiveStream(flow.stream_id, flow.relay, self._route.route)
        entry.sleeper = self  # the drain moves the deadline sooner
        self._streaming.tracker.open(entry)
        self._entries[flow.relay] = (entry, flow)
        return flow.relay

    def _finish(self, relay: Relay, now: float) -> None:
        entry, flow = self._entries.pop(relay)
        self._streaming.pipeline.finish(entry, flow, now)
        self._slots.stream_finished()

    def deadline_now(self) -> None:
        self._wake.set()

    def client_text(self, data: str) -> Reply:
        reply = self.session.client_reply(data, asyncio.get_running_loop().time())
        if reply.opened:
            self._wake.set()  # a stream opened: its timers run from now
        return reply

    def upstream_text(self, data: str) -> Reply:
        return self.session.upstream_message(data, asyncio.get_running_loop().time())

    async def watch(self) -> _Ended:
        """Run the streams' timers; return when one cut its stream."""
        loop = asyncio.get_running_loop()
        session = self.session
        while True:
            self._wake.clear()
            deadline = session.deadline
            if deadline is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(deadline - loop.time(), 0.0))
            error = session.poll(loop.time())
            if error is not None:
                return _Ended(None, error=error)


# What a write to a peer that is gone raises.
_GONE = (ConnectionError, aiohttp.ClientError, RuntimeError)


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


async def _pump(source: _Side, sink: _Side, read: Callable[[str], Reply] | None = None) -> _Ended:
    """Forward messages until ``source`` closes (or ``read`` cuts a stream on one); say how.

    ``read`` sees each text message first and says whether it goes on, what
    goes to ``sink`` in its place, or what goes back to ``source`` instead.
    """
    loop = asyncio.get_running_loop()
    while True:
        message = await source.ws.receive()
        source.heard = loop.time()
        kind = message.type
        if kind == aiohttp.WSMsgType.TEXT:
            if read is None:
                await sink.ws.send_str(message.data)
                continue
            reply = read(message.data)
            if reply.forward:
                await sink.ws.send_str(message.data)
            for rewritten in reply.messages:
                await sink.ws.send_str(rewritten)
            if reply.answer is not None:
                await source.ws.send_str(reply.answer)
            if reply.error is not None:
                return _Ended(None, error=reply.error)
        elif kind == aiohttp.WSMsgType.BINARY:
            await sink.ws.send_bytes(message.data)
        elif kind == aiohttp.WSMsgType.PING:
            await source.ws.pong(message.data)  # hop-by-hop: answered here
        elif kind == aiohttp.WSMsgType.PONG:
            continue
        elif kind == aiohttp.WSMsgType.CLOSE:
            code = message.data
            if not isinstance(code, int) or code in _RESERVED_CLOSE_CODES:
                return _Ended(None)
            return _Ended(code, message.extra or "")
        else:
            # ERROR: a message past max_msg_size, or a broken frame; CLOSING,
            # CLOSED: the peer vanished without a close frame.
            error = message.data
            too_large = (
                isinstance(error, aiohttp.WebSocketError)
                and error.code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
            )
            return _Ended(None, too_large=too_large)
