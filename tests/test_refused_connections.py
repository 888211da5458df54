"""Connections the proxy refuses itself are counted, and their warnings rate-limited.

A flood of malformed or slowloris connections must not become a flood of
log lines: one warning per reason per interval says it is happening, the
metric counts every one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from streamwarden.observation.logs import RateLimitedWarnings
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer

StartSidecar = Callable[..., Awaitable[Sidecar]]

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
