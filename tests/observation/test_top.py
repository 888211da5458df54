"""`GET /streams` and `streamwarden top`: the open streams, live, in a real terminal (tmux)."""

from __future__ import annotations

import asyncio
import shutil
import sys
import uuid

import aiohttp
import pytest

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_for, wait_until

CHAT = "/v1/chat/completions"
SLOW = {"x-mock-tps": "5", "x-mock-ttft": "0", "x-mock-tokens": "400"}


async def open_streams(
    session: aiohttp.ClientSession, url: str, count: int
) -> list[aiohttp.ClientResponse]:
    responses = []
    for _ in range(count):
        response = await session.post(url + CHAT, headers=SLOW, json={"stream": True})
        await response.content.readany()  # the first bytes: the stream is open
        responses.append(response)
    return responses


async def test_streams_lists_the_open_streams_and_the_last_minutes_endings(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    async with aiohttp.ClientSession() as session:
        opened = await open_streams(session, sidecar.proxy_url, 2)
        async with session.get(sidecar.admin_url + "/streams") as answer:
            view = await answer.json()
        assert [s["route"] for s in view["streams"]] == ["/", "/"]
        first = view["streams"][0]
        assert first["dialect"] == "openai-chat" and first["client"] == "connected"
        assert first["age_s"] >= view["streams"][1]["age_s"]  # oldest first
        for response in opened:
            response.close()
        await wait_for(lambda: not sidecar.tracker.active)
        async with session.get(sidecar.admin_url + "/streams") as answer:
            view = await answer.json()
    assert view["streams"] == [] and view["recent"] == {"client_cancelled": 2}


async def capture(session: str) -> str:
    process = await asyncio.create_subprocess_exec(
        "tmux", "capture-pane", "-p", "-t", session, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await process.communicate()
    return out.decode()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
async def test_top_shows_the_open_streams_live_in_a_terminal(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    name = f"top-{uuid.uuid4().hex[:8]}"
    command = (
        f"env COLUMNS=160 {sys.executable} -m streamwarden.cli top"
        f" --admin {sidecar.admin_url} --interval 0.2"
    )
    started = await asyncio.create_subprocess_exec(
        "tmux", "new-session", "-d", "-s", name, "-x", "160", "-y", "40", command
    )
    await started.wait()
    try:

        async def shows(text: str) -> bool:
            return text in await capture(name)

        await wait_until(lambda: shows("0 open streams"), what="top's first screen")
        async with aiohttp.ClientSession() as session:
            opened = await open_streams(session, sidecar.proxy_url, 3)
            await wait_until(lambda: shows("3 open streams"), what="three streams on screen")
            screen = await capture(name)
            assert screen.count("openai-chat") == 3 and screen.count("connected") == 3, screen
            for response in opened:
                response.close()
            await wait_until(
                lambda: shows("client_cancelled 3"), what="the endings of the last minute"
            )
    finally:
        killed = await asyncio.create_subprocess_exec("tmux", "kill-session", "-t", name)
        await killed.wait()
