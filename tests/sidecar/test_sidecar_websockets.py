"""WebSockets stay alive through idle-cutting hops, and dead peers are let go.

Load balancers and corporate proxies cut idle WebSocket connections after
60 to 120 s. Through the sidecar, a side quiet for ``keepalive_interval``
gets a ping; a side that answers nothing for another interval is closed
with 1011. Sessions and their ends are counted in the metrics.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from sidecars import StartSidecar
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from upstreams import ServeUpstream


async def metric(sidecar: Sidecar, line_start: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            text = await response.text()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


async def test_an_idle_websocket_gets_pings_and_stays_open(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    interval = 0.1
    async with aiohttp.ClientSession() as session:
        # Without streamwarden, nothing crosses an idle WebSocket: a hop
        # that cuts idle connections would cut this one.
        async with session.ws_connect(mock.url + "/ws", autoping=False) as ws:
            with pytest.raises(TimeoutError):
                await ws.receive(timeout=5 * interval)

        sidecar = await start_sidecar(mock.url, keepalive_interval=f"{interval}s")
        async with session.ws_connect(sidecar.proxy_url + "/ws", autoping=False) as ws:
            pings = 0
            while pings < 3:  # idle for three intervals
                message = await ws.receive(timeout=10)
                assert message.type == aiohttp.WSMsgType.PING, message
                pings += 1
                await ws.pong(message.data)
            await ws.send_str("still there?")
            message = await ws.receive(timeout=10)
            while message.type == aiohttp.WSMsgType.PING:
                await ws.pong(message.data)
                message = await ws.receive(timeout=10)
            assert message.data == "still there?"
            assert await metric(sidecar, "streamwarden_active_websockets") == 1


async def test_a_peer_that_stops_answering_pings_is_closed_with_1011(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, keepalive_interval="100ms")
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(
            sidecar.proxy_url + "/ws",
            autoping=False,
            headers={"x-mock-request-id": "ws-dead"},
        ) as ws:
            # This client reads, but never answers a ping.
            message = await ws.receive(timeout=10)
            while message.type == aiohttp.WSMsgType.PING:
                message = await ws.receive(timeout=10)
            assert message.type == aiohttp.WSMsgType.CLOSE
            assert message.data == 1011
    record = await mock.stats.wait_ended("ws-dead")
    assert record.close_code == 1001  # the upstream is told its peer went away
    ended = 'streamwarden_websocket_sessions_total{end_state="client_ping_timeout"}'
    assert await metric(sidecar, ended) == 1
    assert await metric(sidecar, "streamwarden_active_websockets") == 0


async def test_an_upstream_that_vanishes_is_an_error_close_never_a_normal_one(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    async def vanishing(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("one")
        assert request.transport is not None
        request.transport.abort()  # no close frame: the peer sees 1006
        return ws

    app = web.Application()
    app.router.add_get("/ws", vanishing)
    upstream = await serve_upstream(app)
    sidecar = await start_sidecar(upstream)
    codes = {}
    async with aiohttp.ClientSession() as session:
        for name, base in (("direct", upstream), ("through", sidecar.proxy_url)):
            async with session.ws_connect(base + "/ws") as ws:
                assert (await ws.receive(timeout=10)).data == "one"
                await ws.receive(timeout=10)
                codes[name] = ws.close_code
    # Directly an abnormal closure; through the sidecar 1011, not 1001 "going away".
    assert codes == {"direct": 1006, "through": 1011}
