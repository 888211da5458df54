"""Connections the proxy refuses itself are counted, and their warnings rate-limited.

A flood of malformed or slowloris connections must not become a flood of
log lines: one warning per reason per interval says it is happening, the
metric counts every one.

Nor may a flood of idle connections take every file descriptor: past
``max_client_connections`` a new client connection gets 503 and is closed
at once, and the sidecar raises its soft open-files limit to the hard one
at start, so that the admin port, the upstreams and the streams in flight
keep working.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecars import StartSidecar
from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_until

LONG_LINE = b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"


async def refused_status(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(5):
            return await reader.readline()
    finally:
        writer.close()


async def test_twenty_malformed_requests_give_one_warning_and_a_count_of_twenty(
    mock: MockServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="streamwarden.proxy")
    sidecar = await start_sidecar(mock.url)
    for _ in range(20):
        assert (await refused_status(sidecar.proxy_port, LONG_LINE)).split()[1] == b"414"
    warnings = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert len(warnings) == 1
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            text = await response.text()
    line = 'streamwarden_refused_connections_total{reason="request_line_too_long"} 20.0'
    assert line in text.splitlines()


def test_a_suppressed_warning_is_counted_in_the_next_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("streamwarden.observation.logs.time.monotonic", lambda: clock[0])
    limiter = RateLimitedWarnings(interval=10.0)
    caplog.set_level(logging.WARNING, logger="streamwarden.proxy")
    for _ in range(5):
        limiter.warn("slow", "slow headers from %s", "client")
    limiter.warn("other", "another reason")
    clock[0] += 10.0
    limiter.warn("slow", "slow headers from %s", "client")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "slow headers from client",
        "another reason",
        "slow headers from client (4 more like it since the last such line)",
    ]


# -- descriptors ------------------------------------------------------------------------

#: systemd's shape (soft 1024, hard far above), scaled down: a test opens a
#: few hundred connections, not thousands.
SOFT, HARD = 64, 512
#: Idle connections the test opens: past what HARD fits, far past SOFT.
IDLE = 200
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def under_open_files_limit(soft: int, hard: int, command: list[str]) -> list[str]:
    """``command`` run with RLIMIT_NOFILE (soft, hard), as a service manager starts it."""
    start = (
        "import os, resource, sys;"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}));"
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", start, *command]


def open_files_of(pid: int) -> tuple[int, int]:
    """The soft and hard open-files limits of a process, as the kernel reports them."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits, re.MULTILINE)
    assert found, limits
    return int(found.group(1)), int(found.group(2))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def idle_connections(port: int, count: int) -> list[asyncio.StreamWriter]:
    """Up to ``count`` connections that send nothing; the first that cannot connect stops it."""
    writers = []
    for _ in range(count):
        try:
            # A SYN the kernel dropped (its accept queue full) is sent again after 1 s, 3 s.
            async with asyncio.timeout(5):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
        except (TimeoutError, OSError):
            break
        writers.append(writer)
    return writers


@pytest.fixture
async def limited_sidecar(
    mock: MockServer, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[subprocess.Popen[bytes], int, int, Path]]:
    """``streamwarden run`` started under a soft open-files limit of SOFT and a hard one of HARD."""
    port, admin = free_port(), free_port()
    config = tmp_path / "config.yaml"
    # No header deadline: the idle connections must stay for the test's length.
    config.write_text(
        f"upstream: {mock.url}\nlisten: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\n"
        f"event_loop: {request.param}\nrequest_header_timeout: 0\nupstream_pool_size: 8\n"
        "drain_timeout: 1s\n"
    )
    log = tmp_path / "stderr.log"
    command = [sys.executable, "-m", "streamwarden.cli", "run", "--config", str(config)]
    with log.open("wb") as stderr:
        process = subprocess.Popen(under_open_files_limit(SOFT, HARD, command), stderr=stderr)
    try:

        async def healthy() -> bool:
            with contextlib.suppress(aiohttp.ClientError):
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{admin}/healthz") as response:
                        return response.status == 200
            return False

        await wait_until(healthy, timeout=30, what="the sidecar's /healthz")
        yield process, port, admin, log
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


@pytest.mark.parametrize("limited_sidecar", ["asyncio", "uvloop"], indirect=True)
async def test_idle_clients_past_the_limit_are_refused_and_the_admin_port_still_answers(
    limited_sidecar: tuple[subprocess.Popen[bytes], int, int, Path],
) -> None:
    process, port, admin, log = limited_sidecar
    proxy = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as streaming, aiohttp.ClientSession() as admin_client:
        # A stream in flight (40 tokens at 10 a second) before the flood.
        headers = {"x-mock-tokens": "40", "x-mock-tps": "10", "x-mock-ttft": "0"}
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with streaming.post(proxy + CHAT, json=body, headers=headers) as stream:
            assert stream.status == 200
            first = await stream.content.readuntil(b"\n\n")
            idle = await idle_connections(port, IDLE)
            try:
                # Without the limit, the process's descriptors are gone by now
                # and the admin port cannot accept: this times out.
                async with asyncio.timeout(10):
                    async with admin_client.get(f"http://127.0.0.1:{admin}/healthz") as health:
                        assert health.status == 200
                assert open_files_of(process.pid) == (HARD, HARD)
                assert len(idle) == IDLE
                # One more client is answered 503, with the machine code, and closed.
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                async with asyncio.timeout(10):
                    refusal = await reader.read()
                writer.close()
                assert refusal.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
                assert b"\r\nRetry-After: 1\r\n" in refusal
                assert json.loads(refusal.partition(b"\r\n\r\n")[2])["error"]["code"] == (
                    "too_many_connections"
                )
                limit = 0

                async def counted() -> bool:
                    nonlocal limit
                    metrics_url = f"http://127.0.0.1:{admin}/metrics"
                    async with admin_client.get(metrics_url) as response:
                        values = samples(await response.text())
                    limit = int(values[("streamwarden_client_connections_limit", ())])
                    refused = values.get(
                        (
                            "streamwarden_refused_connections_total",
                            (("reason", "too_many_connections"),),
                        )
                    )
                    # Held: the stream's and limit - 1 idle ones; refused: the
                    # other idle ones and the one that got the 503.
                    return values[("streamwarden_client_connections", ())] == limit and (
                        refused == IDLE + 2 - limit
                    )

                await wait_until(counted, what="the connections counted and refused")
                assert 0 < limit < IDLE
                # The stream in flight went on and ended whole.
                rest = await stream.content.read()
            finally:
                for writer in idle:
                    writer.close()
    assert first.startswith(b"data: ") and rest.endswith(b"data: [DONE]\n\n")
    assert rest.count(b"data: ") >= 40

    async def freed() -> bool:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{admin}/metrics") as response:
                return samples(await response.text())[("streamwarden_client_connections", ())] == 0

    await wait_until(freed, what="the idle connections' places freed")
    # And a new client is served.
    headers["x-mock-tps"] = "0"
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy + CHAT, json=body, headers=headers) as response:
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)
    lines = log.read_text().splitlines()
    assert any(f"open-files limit raised from {SOFT} to {HARD}" in line for line in lines)
    assert any(f"at most {limit} client connections" in line for line in lines)
    # One line says it is happening; the metric counted every one.
    reached = [line for line in lines if f"max_client_connections ({limit}) reached" in line]
    assert len(reached) == 1, reached


async def test_max_client_connections_refuses_the_one_past_it_and_frees_places(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_client_connections=3, request_header_timeout=0)
    idle = await idle_connections(sidecar.proxy_port, 3)
    try:
        await wait_until(_open_connections(sidecar, 3), what="three connections held")
        assert (await refused_status(sidecar.proxy_port, b"")).split()[1] == b"503"
        assert sidecar.client_connections.open == 3
    finally:
        for writer in idle:
            writer.close()
    await wait_until(_open_connections(sidecar, 0), what="the places freed")
    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            values = samples(await response.text())
        async with session.post(
            sidecar.proxy_url + CHAT, json={"stream": True}, headers={"x-mock-tps": "0"}
        ) as response:
            assert response.status == 200
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert values[("streamwarden_client_connections_limit", ())] == 3
    key = ("streamwarden_refused_connections_total", (("reason", "too_many_connections"),))
    assert values[key] == 1


def _open_connections(sidecar: Sidecar, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return sidecar.client_connections.open == count

    return check
