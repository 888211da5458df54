"""Soak: thousands of mixed streams at a steady concurrency through a sidecar process.

Random dialects, faults and client disconnects. Between the first and the
last quarter of the run the sidecar's tasks, file descriptors and resident
memory must not grow past a stated tolerance, and at the end its metrics
must equal the mock upstream's own counts exactly.

The length is a parameter: ``SOAK_SECONDS=3600 pytest
tests/sidecar/test_soak.py`` soaks for an hour; CI runs the default 15 seconds.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamwarden.tools.mock import MockServer

SECONDS = float(os.environ.get("SOAK_SECONDS", "15"))
CONCURRENCY = 30
# Growth allowed from the first quarter's peak to the last quarter's peak.
RSS_TOLERANCE = 8 * 1024 * 1024
FD_TOLERANCE = 8
TASK_TOLERANCE = 8

PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat"]
# (fault, client behaviour): the client leaves only while the upstream is
# silent, so every token the mock sent was read and the counts can be exact.
PLANS = [
    (None, "read"),
    (None, "read"),
    ("truncate", "read"),
    ("truncate-mid", "read"),
    ("stall", "leave"),
    ("stall", "timeout"),
    ("error-status", "read"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def process_sample(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url) as response:
        text = await response.text()
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
            if sample.name == "streamwarden_streams_total":
                totals["state:" + sample.labels["end_state"]] += sample.value
    return dict(totals)


async def one_stream(session: aiohttp.ClientSession, base: str, rng: random.Random, n: int) -> str:
    fault, behaviour = rng.choice(PLANS)
    headers = {
        "x-mock-tps": "400",
        "x-mock-ttft": "0",
        "x-mock-tokens": str(rng.randint(4, 24)),
        "x-mock-request-id": f"soak-{n}",
        "x-mock-size": "300000",
    }
    if fault:
        headers["x-mock-fault"] = fault
    if fault == "stall":
        headers["x-mock-fault-after"] = "2"
    request = {"stream": True, "stream_options": {"include_usage": True}}
    async with session.post(base + rng.choice(PATHS), headers=headers, json=request) as response:
        if behaviour == "leave":
            seen = b""
            async with asyncio.timeout(5):
                while seen.count(b"\n") < 4:
                    chunk = await response.content.readany()
                    if not chunk:  # ended before we could leave
                        return "read"
                    seen += chunk
            await asyncio.sleep(0.02)  # the stimulus: the client stays while the upstream is silent
            response.close()
            return "left"
        await response.read()
    return behaviour


@pytest.fixture
def short_gc_pauses() -> Iterator[None]:
    """Keep this process's garbage collector from pausing the mock for long.

    The mock and the clients run in the test process. Once other tests have
    loaded the SDKs, a full collection pauses the mock for longer than the
    sidecar's 150 ms idle timeout, which then cuts a healthy stream with
    tokens on the wire that the mock counted and the sidecar never read (seen
    after tests/faces/test_sdk_error_events.py). Frozen, what is loaded is never
    walked again.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


async def test_soak_no_growth_and_exact_counts(
    mock: MockServer, tmp_path: Path, short_gc_pauses: None
) -> None:
    port, admin = free_port(), free_port()
    config = tmp_path / "soak.yaml"
    config.write_text(
        f"upstream: {mock.url}\nlisten: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\n"
        "upstream_idle_timeout: 150ms\nmax_event_bytes: 64KiB\nkeepalive_interval: 100ms\n"
        "log_level: warning\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "streamwarden.cli", "run", "--config", str(config)],
        stderr=open(tmp_path / "sidecar.log", "w"),  # noqa: SIM115
    )
    base = f"http://127.0.0.1:{port}"
    metrics_url = f"http://127.0.0.1:{admin}/metrics"
    samples: list[tuple[float, int, int, float]] = []
    outcomes: Counter[str] = Counter()
    try:
        async with asyncio.timeout(10):
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    await asyncio.sleep(0.02)
        rng = random.Random(7)
        start = time.monotonic()
        counter = iter(range(10**9))
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                while time.monotonic() - start < SECONDS:
                    try:
                        outcomes[await one_stream(session, base, rng, next(counter))] += 1
                    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                        outcomes[type(exc).__name__] += 1

            async def sampler() -> None:
                while time.monotonic() - start < SECONDS:
                    rss, fds = process_sample(process.pid)
                    tasks = (await scrape(session, metrics_url))["streamwarden_asyncio_tasks"]
                    samples.append((time.monotonic() - start, rss, fds, tasks))
                    await asyncio.sleep(0.25)

            async with asyncio.timeout(SECONDS + 60):
                await asyncio.gather(sampler(), *(worker() for _ in range(CONCURRENCY)))
            async with asyncio.timeout(10):
                while any(not record.ended for record in mock.stats.records):
                    await asyncio.sleep(0.02)
            # Until the sidecar has recorded every stream the mock served (the
            # assertions below say what is missing if it never does).
            expected = len(mock.stats.records) - outcomes_error_status(mock)
            deadline = time.monotonic() + 10
            totals = await scrape(session, metrics_url)
            while time.monotonic() < deadline and (
                totals.get("streamwarden_streams_total", 0) < expected
                or totals.get("streamwarden_active_streams", 0)
            ):
                await asyncio.sleep(0.05)
                totals = await scrape(session, metrics_url)
    finally:
        process.terminate()
        process.wait(timeout=10)

    streams = len(mock.stats.records)
    print(f"soak: {streams} streams in {SECONDS:g}s, outcomes {dict(outcomes)}")
    assert streams > 1000 or SECONDS < 15
    assert outcomes["left"] > 0 and outcomes["read"] > 0
    assert set(outcomes) <= {"read", "left", "timeout"}, outcomes

    quarter = SECONDS / 4
    first = [s for s in samples if s[0] <= quarter]
    last = [s for s in samples if s[0] >= 3 * quarter]
    assert first and last
    assert max(s[1] for s in last) - max(s[1] for s in first) < RSS_TOLERANCE
    assert max(s[2] for s in last) - max(s[2] for s in first) < FD_TOLERANCE
    assert max(s[3] for s in last) - max(s[3] for s in first) < TASK_TOLERANCE

    # The sidecar's metrics against the mock's own ground truth.
    assert totals["streamwarden_streams_total"] == streams - outcomes_error_status(mock)
    assert totals["streamwarden_active_streams"] == 0
    relayed = [r for r in mock.stats.records if r.status == 200]
    assert totals["streamwarden_tokens_generated_total"] == sum(r.tokens_generated for r in relayed)
    completed = sum(1 for r in relayed if r.completed)
    assert totals.get("state:completed", 0) == completed
    left = sum(1 for r in relayed if r.closed_early and r.fault == "stall")
    assert totals.get("state:client_cancelled", 0) + totals.get("state:upstream_timeout", 0) == (
        left + sum(1 for r in relayed if r.fault == "stall" and not r.closed_early)
    )


def outcomes_error_status(mock: MockServer) -> int:
    """Requests the mock answered with an error status: not streams, so not counted as such."""
    return sum(1 for record in mock.stats.records if record.status != 200)
