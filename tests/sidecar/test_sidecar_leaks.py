"""Nothing is left behind: 1,000 mixed streams with random faults and disconnects."""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections import Counter

import aiohttp

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_until_settled

PATHS = [
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/responses",
    "/v1beta/models/m:streamGenerateContent?alt=sse",
    "/api/chat",
]
FAULTS = [None, None, None, "truncate", "truncate-mid", "reset", "stall", "garbage"]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def usage() -> tuple[int, int]:
    """(asyncio tasks of this loop, open file descriptors of this process)."""
    return len(asyncio.all_tasks()), open_fds()


async def one_stream(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    headers = {"x-mock-tps": "200", "x-mock-ttft": "0", "x-mock-tokens": "12"}
    fault = rng.choice(FAULTS)
    if fault:
        headers["x-mock-fault"] = fault
    leave_after = rng.choice([None, None, 0, 1, 3, 6])  # reads before the client hangs up
    async with session.post(url + rng.choice(PATHS), headers=headers, json={"stream": True}) as r:
        reads = 0
        async for _ in r.content.iter_any():
            reads += 1
            if leave_after is not None and reads > leave_after:
                r.close()  # drop the connection mid-stream
                return "left"
    return "read"


async def test_a_thousand_mixed_streams_leave_no_task_connection_or_fd_behind(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(
        mock.url, upstream_idle_timeout="150ms", keepalive_interval="50ms"
    )
    rng = random.Random(20261201)
    # Warm up once so lazily created objects are part of the baseline.
    async with aiohttp.ClientSession() as session:
        await one_stream(session, sidecar.proxy_url, random.Random(1))
    # The baseline once the warm-up's closes have all landed.
    await wait_until_settled(usage, quiet=0.2)
    gc.collect()
    tasks_before, fds_before = usage()

    outcomes: Counter[str] = Counter()
    semaphore = asyncio.Semaphore(40)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def bounded(i: int) -> None:
            async with semaphore:
                try:
                    outcomes[await one_stream(session, sidecar.proxy_url, rng)] += 1
                except (aiohttp.ClientError, OSError):
                    outcomes["client error"] += 1

        async with asyncio.timeout(120):
            await asyncio.gather(*(bounded(i) for i in range(1000)))

    # Let the last cancellations and closes land.
    async with asyncio.timeout(10):
        while sidecar.tracker.active or any(not r.ended for r in mock.stats.records):
            await asyncio.sleep(0.02)
    # Then until the last handler tasks have ended and their sockets closed.
    await wait_until_settled(usage, quiet=0.3)
    gc.collect()

    assert sum(outcomes.values()) == 1000
    assert outcomes["left"] > 100 and outcomes["read"] > 100
    finished = [r for r in sidecar.tracker.finished if r.meter.end_state is not None]
    assert len(sidecar.tracker.finished) == 1000  # every stream recorded, exactly once
    states = Counter(str(r.meter.end_state) for r in finished)
    assert states["completed"] > 100
    assert states["client_cancelled"] > 50
    assert states["upstream_truncated"] > 50
    assert states["upstream_error"] > 20
    assert not sidecar.tracker.active
    # Every upstream connection was closed or returned to the pool.
    pool = sidecar.proxy.pool
    assert pool is not None
    assert not pool.busy
    # Idle keep-alive connections in the pool are not leaks: each holds a
    # socket at both ends (both in this process) and a handler task in the mock.
    idle = pool.idle_count
    assert idle <= 40
    assert len(asyncio.all_tasks()) <= tasks_before + idle + 2, asyncio.all_tasks()
    assert open_fds() <= fds_before + 2 * idle + 10, (fds_before, open_fds(), idle)
    # The mock saw every request end.
    assert all(record.ended for record in mock.stats.records)
