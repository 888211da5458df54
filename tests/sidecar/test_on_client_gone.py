"""``on_client_gone``: what the upstream gets when the client leaves mid-stream.

``cancel`` (the default) closes the upstream at once, so the inference
server aborts the generation; its final usage never arrives, and the
tokens it had made are known only by estimate. ``drain`` reads the upstream
to its end, writing nothing more: the generation's final usage is metered
exactly (for billing, or for backends that misbehave on an abort), and
what was generated after the client left counts as zombie tokens.
"""

from __future__ import annotations

import aiohttp
import pytest

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_for

CHAT = "/v1/chat/completions"
TOKENS = 40


async def leave_after_the_first_token(url: str, request_id: str) -> None:
    headers = {
        "x-mock-tps": "200",
        "x-mock-ttft": "0",
        "x-mock-tokens": str(TOKENS),
        "x-mock-request-id": request_id,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=headers, json={"stream": True}) as response:
            received = b""
            while received.count(b'"content":"') < 2:  # the role chunk and one token
                received += await response.content.readany()
            response.close()  # the client leaves


async def test_cancel_closes_the_upstream_and_its_usage_never_arrives(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    await leave_after_the_first_token(sidecar.proxy_url, "cancelled")
    upstream = await mock.stats.wait_ended("cancelled")
    assert upstream.closed_early and upstream.tokens_generated < TOKENS
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    meter = sidecar.tracker.finished[-1].meter
    assert meter.end_state == "client_cancelled"
    assert not meter.usage_final  # the usage chunk never came


@pytest.mark.parametrize("where", ["global", "route"])
async def test_drain_reads_the_upstream_to_its_end_and_meters_its_final_usage(
    mock: MockServer, start_sidecar: StartSidecar, where: str
) -> None:
    settings: dict[str, object] = (
        {"on_client_gone": "drain"}
        if where == "global"
        else {"routes": {"/v1/chat": {"on_client_gone": "drain"}}}
    )
    sidecar = await start_sidecar(mock.url, **settings)
    await leave_after_the_first_token(sidecar.proxy_url, f"drained-{where}")
    upstream = await mock.stats.wait_ended(f"drained-{where}")
    assert not upstream.closed_early and upstream.tokens_generated == TOKENS
    await wait_for(lambda: len(sidecar.tracker.finished) == 1, what="the drained stream's record")
    meter = sidecar.tracker.finished[-1].meter
    assert meter.end_state == "drained"
    assert meter.usage_final and meter.tokens_generated == TOKENS
    assert meter.tokens_zombie == TOKENS - meter.tokens_delivered > 0
    assert not sidecar.tracker.active
    pool = sidecar.proxy.pool
    assert pool is not None and not pool.busy
    assert pool.idle_count == 1  # read to its end: the connection is whole


async def test_a_draining_stream_still_ends_on_the_process_drain(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="drain", drain_timeout="100ms")
    headers = {
        "x-mock-tps": "5",
        "x-mock-ttft": "0",
        "x-mock-tokens": "400",
        "x-mock-request-id": "long",
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + CHAT, headers=headers, json={"stream": True}
        ) as response:
            await response.content.readany()
            response.close()
    await wait_for(lambda: len(sidecar.tracker.active) == 1, what="the stream drains on")
    await sidecar.drain()
    assert sidecar.tracker.finished[-1].meter.end_state == "shutdown"
    assert (await mock.stats.wait_ended("long")).closed_early
