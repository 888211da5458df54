"""Hostile clients and upstreams at the proxy's edge: precise refusals, no hangs, no leaks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_for, wait_until_settled


async def exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    """Send raw bytes, return the status line (or b"" if the server closed silently)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(timeout):
            return await reader.readline()
    finally:
        writer.close()


LONG_LINE = b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
LONG_HEADER = b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-SECRET" + b"a" * 20000
LONG_HEADER += b"\r\n\r\n"
MANY_HEADERS = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(300))
MANY_HEADERS += b"\r\n"


async def test_oversized_request_parts_get_414_and_431_and_log_no_secret(
    mock: MockServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sidecar = await start_sidecar(mock.url)
    # aiohttp alone (the mock) answers all three with a bare 400.
    assert (await exchange(mock.port, LONG_LINE)).split()[1] == b"400"
    assert (await exchange(sidecar.proxy_port, LONG_LINE)).split()[1] == b"414"
    assert (await exchange(sidecar.proxy_port, LONG_HEADER)).split()[1] == b"431"
    assert (await exchange(sidecar.proxy_port, MANY_HEADERS)).split()[1] == b"431"
    assert "sk-SECRET" not in caplog.text
    assert "refused a malformed request" in caplog.text
    assert mock.stats.records == ()  # nothing reached the upstream


def test_the_pure_python_parser_gets_the_same_refusals(pure_python_sidecar: int) -> None:
    port = pure_python_sidecar
    results = subprocess.run(
        [
            sys.executable,
            "-c",
            f"""
import asyncio, socket
async def status(data):
    r, w = await asyncio.open_connection("127.0.0.1", {port})
    w.write(data)
    line = await r.readline()
    w.close()
    return line.split()[1].decode()
async def main():
    codes = [await status(d) for d in ({LONG_LINE!r}, {LONG_HEADER!r}, {MANY_HEADERS!r})]
    print(*codes)
asyncio.run(main())
""",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert results.stdout.split() == ["414", "431", "431"], results.stderr


@pytest.fixture
def pure_python_sidecar(mock: MockServer) -> Iterator[int]:
    """A sidecar subprocess running aiohttp's pure-Python HTTP parser."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        admin = sock.getsockname()[1]
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
            f"127.0.0.1:{admin}",
        ],
        env={**os.environ, "AIOHTTP_NO_EXTENSIONS": "1"},
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    yield port
    process.terminate()
    process.wait(timeout=10)


async def trickle(port: int, data: bytes, interval: float, budget: float) -> tuple[bytes, int]:
    """Send ``data`` a byte every ``interval``; return what came back and how many bytes went."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = b""
    sent = 0
    try:
        async with asyncio.timeout(budget):
            for i in range(len(data)):
                writer.write(data[i : i + 1])
                await writer.drain()
                sent += 1
                try:
                    async with asyncio.timeout(interval):
                        received += await reader.read(1024)
                except TimeoutError:
                    continue  # the pace of the trickle
                if received:
                    break
    except (TimeoutError, ConnectionError):
        pass
    writer.close()
    return received, sent


async def test_slowloris_headers_are_cut_with_408(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    request = b"GET /echo/x HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 100 + b"\r\n\r\n"
    # aiohttp alone waits for as long as the client cares to trickle.
    received, _ = await trickle(mock.port, request, 0.05, budget=1.5)
    assert received == b""
    sidecar = await start_sidecar(mock.url, request_header_timeout="500ms")
    # The same headers sent at once are served: the 408 is for their pace.
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.proxy_url + "/echo/x", headers={"X-A": "a" * 100}) as r:
            assert r.status == 200
    # Trickled (a byte each 50 ms: 7 s in all), they are cut before their end.
    received, sent = await trickle(sidecar.proxy_port, request, 0.05, budget=15)
    assert received.startswith(b"HTTP/1.1 408")
    assert 1 < sent < len(request)


async def test_a_slow_body_is_not_cut_by_the_header_deadline(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, request_header_timeout="300ms")

    async def slow_body() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"x" * 10
            await asyncio.sleep(0.1)

    async with aiohttp.ClientSession() as session:
        async with session.post(sidecar.proxy_url + "/echo/slow", data=slow_body()) as response:
            assert response.status == 200
            assert (await response.json())["body_bytes"] == 80


async def test_kept_alive_connection_still_serves_after_the_deadline(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, request_header_timeout="200ms")
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.get(sidecar.proxy_url + "/echo/a") as response:
                assert response.status == 200
            await asyncio.sleep(0.3)  # idle longer than the header deadline


@pytest.fixture
async def injecting_upstream() -> AsyncIterator[int]:
    """A raw upstream whose response header value carries a bare CR (a smuggling attempt)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"X-Evil: a\rSet-Cookie: stolen=1\r\nContent-Length: 14\r\n\r\ndata: x\n\n\n\n\n\n\n"
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_header_injection_from_the_upstream_is_refused(
    injecting_upstream: int, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(f"http://127.0.0.1:{injecting_upstream}")
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.proxy_url + "/x") as response:
            assert response.status == 502
            assert "stolen" not in str(response.headers)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_thousands_of_abandoned_connections_leave_nothing_behind(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, request_header_timeout="300ms")
    fds_before = await wait_until_settled(open_fds, quiet=0.2)
    for batch in range(10):
        writers = []
        for i in range(200):
            _, writer = await asyncio.open_connection("127.0.0.1", sidecar.proxy_port)
            if i % 2:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            writers.append(writer)
        # The stimulus: the connections sit open a moment before they are cut,
        # so the sidecar accepts them and reads the half heads first.
        await asyncio.sleep(0.01)
        for writer in writers:
            writer.transport.abort()
        del batch
    # The sidecar closes its side of each cut connection as it notices; if it
    # never does, the assertion below says by how much.
    with contextlib.suppress(AssertionError):
        await wait_for(lambda: open_fds() <= fds_before + 5, what="the cut connections closed")
    assert open_fds() <= fds_before + 5
    assert not sidecar.tracker.active
    assert mock.stats.records == ()
