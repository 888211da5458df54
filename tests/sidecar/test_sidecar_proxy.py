"""The sidecar as a transparent reverse proxy: what reaches the upstream, what comes back."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer, create_app
from upstreams import ServeUpstream


async def echo(url: str, method: str = "POST", **kwargs: object) -> dict[str, object]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, **kwargs) as response:  # type: ignore[arg-type]
            assert response.status == 200
            return await response.json()  # type: ignore[no-any-return]


def header(described: dict[str, object], name: str) -> list[str]:
    pairs = described["headers"]
    assert isinstance(pairs, list)
    return [value for key, value in pairs if key.lower() == name.lower()]


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
async def test_method_path_query_and_body_reach_the_upstream_unchanged(
    mock: MockServer, start_sidecar: StartSidecar, method: str
) -> None:
    sidecar = await start_sidecar(mock.url)
    target = "/echo/a%2Fb/%E6%97%A5?q=1&q=2&x=%20y&empty="
    body = os.urandom(3000)
    direct = await echo(mock.url + target, method, data=body)
    proxied = await echo(sidecar.proxy_url + target, method, data=body)
    for key in ("method", "path", "query_string", "body_bytes", "body_sha256"):
        assert proxied[key] == direct[key], key
    assert proxied["path"] == "/echo/a%2Fb/%E6%97%A5"
    assert proxied["query_string"] == "q=1&q=2&x=%20y&empty="
    assert proxied["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_hop_by_hop_headers_are_dropped_and_forwarded_headers_added(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, trusted_proxies=["127.0.0.0/8"])
    headers = {
        "Connection": "keep-alive, X-Secret-Hop",
        "X-Secret-Hop": "1",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Proxy-Authorization": "Basic x",
        "Authorization": "Bearer sk-test",
        "X-Custom": "kept",
        "X-Forwarded-For": "10.1.2.3",
    }
    described = await echo(sidecar.proxy_url + "/echo/h", headers=headers)
    names = {key.lower() for key, _ in described["headers"]}  # type: ignore[union-attr]
    for dropped in ("x-secret-hop", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in names
    assert header(described, "authorization") == ["Bearer sk-test"]
    assert header(described, "x-custom") == ["kept"]
    assert header(described, "x-forwarded-for") == ["10.1.2.3, 127.0.0.1"]
    assert header(described, "x-forwarded-proto") == ["http"]
    assert header(described, "x-forwarded-host") == [f"127.0.0.1:{sidecar.proxy_port}"]
    # Host is the upstream's own unless configured otherwise.
    assert header(described, "host") == [f"127.0.0.1:{mock.port}"]


async def test_forwarding_headers_from_an_untrusted_peer_are_replaced_not_believed(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    lies = {
        "X-Forwarded-For": "203.0.113.7",
        "Forwarded": "for=203.0.113.7;proto=https",
        "X-Real-IP": "203.0.113.7",
    }
    # Without streamwarden the upstream believes whatever the client says.
    direct = await echo(mock.url + "/echo/h", headers=lies)
    assert header(direct, "x-real-ip") == ["203.0.113.7"]

    sidecar = await start_sidecar(mock.url)  # trusted_proxies: none
    described = await echo(sidecar.proxy_url + "/echo/h", headers=lies)
    assert header(described, "x-forwarded-for") == ["127.0.0.1"]
    assert header(described, "x-real-ip") == ["127.0.0.1"]
    assert header(described, "forwarded") == []

    trusting = await start_sidecar(mock.url, trusted_proxies="127.0.0.1/32, ::1")
    described = await echo(trusting.proxy_url + "/echo/h", headers=lies)
    assert header(described, "x-forwarded-for") == ["203.0.113.7, 127.0.0.1"]
    assert header(described, "x-real-ip") == ["203.0.113.7"]
    assert header(described, "forwarded") == ["for=203.0.113.7;proto=https"]


async def test_preserve_host_sends_the_clients_host(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, preserve_host=True)
    described = await echo(sidecar.proxy_url + "/echo/h", headers={"Host": "api.example"})
    assert header(described, "host") == ["api.example"]


FIXED_BODY = json.dumps({"id": "cmpl-1", "choices": [{"message": {"content": "日本 ✓"}}]}).encode()


@pytest.fixture
async def fixed_upstream(serve_upstream: ServeUpstream) -> str:
    """Answers every request with the same JSON body and a few telling headers."""

    async def handler(request: web.Request) -> web.Response:
        response = web.Response(
            body=FIXED_BODY,
            status=201,
            headers={"Content-Type": "application/json; charset=utf-8"},
        )
        response.headers.add("Set-Cookie", "a=1")
        response.headers.add("Set-Cookie", "b=2")
        response.headers["X-Request-Echo"] = request.headers.get("X-Custom", "")
        response.headers["Connection"] = "keep-alive, X-Hop"
        response.headers["X-Hop"] = "should not pass"
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return await serve_upstream(app)


async def test_non_streamed_json_passes_through_byte_for_byte(
    fixed_upstream: str, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(fixed_upstream)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + "/v1/chat/completions", json={}, headers={"X-Custom": "c"}
        ) as response:
            assert response.status == 201
            assert await response.read() == FIXED_BODY
            assert response.headers["Content-Length"] == str(len(FIXED_BODY))
            assert response.headers["Content-Type"] == "application/json; charset=utf-8"
            assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
            assert response.headers["X-Request-Echo"] == "c"
            assert "X-Hop" not in response.headers  # named by Connection: hop-by-hop
            assert "X-Accel-Buffering" not in response.headers  # not a stream
    assert len(sidecar.tracker.finished) == 0


@pytest.fixture
async def gzip_upstream(serve_upstream: ServeUpstream) -> str:
    """An upstream that compresses both its JSON and its event stream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/json":
            return web.Response(
                body=gzip.compress(b'{"ok": true}'),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"}
        )
        await response.prepare(request)
        compressor = __import__("zlib").compressobj(wbits=31)
        for i in range(3):
            data = compressor.compress(f"data: event {i}\n\n".encode())
            data += compressor.flush(__import__("zlib").Z_SYNC_FLUSH)
            await response.write(data)
            await asyncio.sleep(0.01)
        await response.write(compressor.flush())
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    return await serve_upstream(app)


async def test_compressed_json_passes_through_and_compressed_stream_is_decoded(
    gzip_upstream: str, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(gzip_upstream)
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.get(sidecar.proxy_url + "/json") as response:
            assert response.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(await response.read()) == b'{"ok": true}'
        async with session.get(sidecar.proxy_url + "/events") as response:
            assert "Content-Encoding" not in response.headers
            assert await response.read() == b"data: event 0\n\ndata: event 1\n\ndata: event 2\n\n"


async def test_large_upload_is_streamed_not_buffered(mock: MockServer, tmp_path: Path) -> None:
    """A 50 MiB upload through a real sidecar process costs it far less than 50 MiB."""
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamwarden.cli",
            "run",
            "--upstream",
            mock.url,
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{_free_port()}",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        await _wait_port(port)
        baseline = _rss(process.pid)
        peak = baseline
        size = 50 * 1024 * 1024
        block = os.urandom(1024 * 1024)
        digest = hashlib.sha256(block * 50).hexdigest()

        async def body() -> AsyncIterator[bytes]:
            for _ in range(50):
                yield block

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _rss(process.pid))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        described = await echo(f"http://127.0.0.1:{port}/echo/upload", data=body())
        sampler.cancel()
        assert described["body_bytes"] == size
        assert described["body_sha256"] == digest
        assert peak - baseline < 16 * 1024 * 1024, (baseline, peak)
    finally:
        process.terminate()
        process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_port(port: int) -> None:
    async with asyncio.timeout(10):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.02)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def test_request_body_over_the_limit_is_refused(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_request_body_bytes="64KiB")
    async with aiohttp.ClientSession() as session:
        async with session.post(sidecar.proxy_url + "/echo/x", data=b"x" * 70000) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == "request_too_large"

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b"x" * 10000

        async with session.post(sidecar.proxy_url + "/echo/x", data=chunked()) as response:
            assert response.status == 413


async def test_websocket_messages_and_close_codes_flow_both_ways(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(sidecar.proxy_url + "/ws") as ws:
            await ws.send_str("héllo")
            assert (await ws.receive_str()) == "héllo"
            await ws.send_bytes(b"\x00\xff binary")
            assert (await ws.receive_bytes()) == b"\x00\xff binary"
            await ws.send_str("close:4001")  # the upstream closes with 4001
            message = await ws.receive()
            assert message.type == aiohttp.WSMsgType.CLOSE
            assert message.data == 4001
        # The client closes with a code: the upstream sees the same code.
        async with session.ws_connect(
            sidecar.proxy_url + "/ws", headers={"x-mock-request-id": "ws-close"}
        ) as ws:
            await ws.send_str("ping")
            await ws.receive_str()
            await ws.close(code=4002, message=b"bye")
    record = await mock.stats.wait_ended("ws-close")
    assert record.close_code == 4002


async def test_websocket_client_vanishing_closes_the_upstream(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.proxy_port)
    writer.write(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"x-mock-request-id: ws-vanish\r\n\r\n"
    )
    assert b"101" in await reader.readline()
    writer.transport.abort()
    record = await mock.stats.wait_ended("ws-vanish", timeout=3)
    assert record.ended


@pytest.fixture
def tls() -> tuple[trustme.CA, trustme.LeafCert]:
    ca = trustme.CA()
    return ca, ca.issue_cert("127.0.0.1", "localhost")


async def test_https_upstream_with_a_configured_ca_bundle(
    start_sidecar: StartSidecar,
    tls: tuple[trustme.CA, trustme.LeafCert],
    tmp_path: Path,
    serve_upstream: ServeUpstream,
) -> None:
    ca, cert = tls
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_context)
    url = await serve_upstream(create_app(), handler_cancellation=True, ssl_context=server_context)
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    untrusted = await start_sidecar(url)
    async with aiohttp.ClientSession() as session:
        async with session.get(untrusted.proxy_url + "/echo/x") as response:
            assert response.status == 502  # the system store does not know our CA
    sidecar = await start_sidecar(url, upstream_ca_bundle=str(bundle))
    described = await echo(sidecar.proxy_url + "/echo/tls", "GET")
    assert described["path"] == "/echo/tls"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + "/v1/chat/completions",
            json={"stream": True},
            headers={"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "5"},
        ) as response:
            assert b"data: [DONE]" in await response.read()
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"


async def test_unix_socket_upstream(start_sidecar: StartSidecar, tmp_path: Path) -> None:
    path = tmp_path / "upstream.sock"
    # On a Unix socket, not a loopback port: the one upstream tests/upstreams.py does not serve.
    runner = web.AppRunner(create_app(), handler_cancellation=True)
    await runner.setup()
    site = web.UnixSite(runner, str(path))
    await site.start()
    try:
        sidecar = await start_sidecar(f"unix:{path}")
        described = await echo(sidecar.proxy_url + "/echo/unix?a=1", data=b"body")
        assert (described["path"], described["query_string"]) == ("/echo/unix", "a=1")
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sidecar.proxy_url + "/v1/messages",
                json={"stream": True},
                headers={"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "5"},
            ) as response:
                assert b"message_stop" in await response.read()
        assert sidecar.tracker.finished[-1].meter.end_state == "completed"
    finally:
        await runner.cleanup()


async def raw_exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    return head


async def test_no_open_proxy_absolute_form_and_connect_are_refused(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    absolute = await raw_exchange(
        sidecar.proxy_port, b"GET http://169.254.169.254/latest HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert absolute.startswith(b"HTTP/1.1 400")
    connect = await raw_exchange(
        sidecar.proxy_port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
    )
    assert connect.split(b" ")[1] in (b"400", b"405")
    assert mock.stats.records == ()  # nothing reached the upstream


async def test_an_expectation_other_than_100_continue_is_a_417_and_nothing_is_forwarded(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    head = await raw_exchange(
        sidecar.proxy_port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\n"
        b"Content-Length: 2\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 417")
    continued = await raw_exchange(
        sidecar.proxy_port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\n"
        b"Content-Length: 2\r\n\r\n",
    )
    # The interim answer comes before the body is sent (here: never sent).
    assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert mock.stats.records == ()


async def test_admin_port_and_proxy_port_never_mix(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            assert response.status == 200
            assert "streamwarden_active_streams" in await response.text()
        async with session.get(sidecar.admin_url + "/echo/x") as response:
            assert response.status == 404  # the admin port proxies nothing
        async with session.get(
            sidecar.proxy_url + "/metrics", headers={"x-mock-tps": "0", "x-mock-ttft": "0"}
        ) as response:
            assert "streamwarden_active_streams" not in await response.text()
        async with session.get(sidecar.admin_url + "/healthz") as response:
            assert response.status == 200
        async with session.get(sidecar.admin_url + "/readyz") as response:
            assert response.status == 200


async def test_unreachable_upstream_is_a_502_with_a_json_body(start_sidecar: StartSidecar) -> None:
    # A refused connection is answered as refused, not after the connect
    # timeout: an hour here, and the test's bound is 10 s.
    sidecar = await start_sidecar(f"http://127.0.0.1:{_free_port()}", upstream_connect_timeout=3600)
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        async with session.post(sidecar.proxy_url + "/v1/chat/completions") as response:
            assert response.status == 502
            assert (await response.json())["error"]["code"] == "upstream_unreachable"


async def test_upstream_slow_to_answer_is_a_504(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, upstream_headers_timeout="200ms")
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + "/v1/chat/completions",
            json={"stream": True},
            headers={"x-mock-fault": "slow-headers", "x-mock-delay": "5"},
        ) as response:
            assert response.status == 504
            assert json.loads(await response.read())["error"]["code"] == "upstream_timeout"


async def test_upstream_error_status_passes_through(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    for status in (429, 500, 503):
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sidecar.proxy_url + "/v1/chat/completions",
                json={"stream": True},
                headers={"x-mock-fault": "error-status", "x-mock-status": str(status)},
            ) as response:
                assert response.status == status
