"""Streams read on after their client left keep their slot and their place until they end.

On a route with ``on_client_gone: drain`` or ``detach`` the upstream is read
on after the client leaves: the generation goes on, and its upstream
connection stays open. If the stream gave its ``max_concurrent_streams``
slot (or its place under ``max_client_connections``) back when its client
left, one client could open a stream, leave, and ask again, as often as it
likes: every generation would run on, GPU burned for nobody and a socket
held each, while the limit says 2. So a stream read on keeps both until it
truly ends (its drain's end, its resume window, a limit, a stop), and a
new client past a limit gets the usual refusal.
"""

from __future__ import annotations

import aiohttp
import pytest

from resume_client import KEY, read_events, text_of
from sidecars import StartSidecar
from streamwarden.core.lifecycle import Phase
from streamwarden.features.resume.model import STREAM_ID_HEADER
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from streamwarden.tools.mock.tokens import mock_text
from waiting import wait_for

CHAT = "/v1/chat/completions"
CLIENTS = 6
LIMIT = 2
#: Far longer than the test (80 s at 5 tokens a second): the generations of
#: clients that left run on until the sidecar stops them.
LONG = {"x-mock-tps": "5", "x-mock-ttft": "0", "x-mock-tokens": "400"}
#: How each policy is set, long enough that only its end frees what it holds.
POLICIES = {
    "drain": {"on_client_gone": "drain"},
    "detach": {"on_client_gone": "detach", "resume_window": "5m"},
}


def read_on(sidecar: Sidecar) -> int:
    """Streams the sidecar reads on after their client left."""
    return sum(1 for s in sidecar.tracker.active if s.relay.lifecycle.phase is not Phase.STREAMING)


def generations_running(mock: MockServer) -> int:
    """Streams the upstream is generating right now: its own count, not ours."""
    return sum(1 for record in mock.stats.records if not record.ended)


async def open_and_leave(sidecar: Sidecar, request_id: str, **headers: str) -> str:
    """Ask for a stream and leave after its first token; what the client got.

    ``"streamed"`` once the sidecar reads the stream on without it, else the
    refusal's error code (an HTTP refusal), or ``"too_many_connections"`` for a
    connection the listener refused as it was accepted (the client may see
    its 503 or only the close).
    """
    sent = {**LONG, "x-mock-request-id": request_id, **KEY, **headers}
    already = read_on(sidecar)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sidecar.proxy_url + CHAT, headers=sent, json={"stream": True}
            ) as response:
                if response.status != 200:
                    code: str = (await response.json(content_type=None))["error"]["code"]
                    return code
                await read_events(response, until=lambda got: len(got) >= 2)
                response.close()  # the client leaves
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        return "too_many_connections"
    await wait_for(lambda: read_on(sidecar) == already + 1, what="read on without its client")
    return "streamed"


@pytest.mark.parametrize("policy", sorted(POLICIES))
async def test_leaving_and_asking_again_never_runs_more_generations_than_the_limit(
    mock: MockServer, start_sidecar: StartSidecar, policy: str
) -> None:
    sidecar = await start_sidecar(mock.url, max_concurrent_streams=LIMIT, **POLICIES[policy])
    got = [await open_and_leave(sidecar, f"{policy}-{n}") for n in range(CLIENTS)]
    # The first streams run on for nobody, holding their slots: every
    # client after them is refused, whatever it does.
    assert got == ["streamed"] * LIMIT + ["too_many_streams"] * (CLIENTS - LIMIT)
    assert generations_running(mock) == LIMIT
    assert len(mock.stats.records) == LIMIT  # the refused never reached the upstream


async def test_a_drained_stream_gives_its_slot_back_when_its_drain_ends(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_concurrent_streams=1, on_client_gone="drain")
    # 3 s of drain: far more than a refused request takes, far less than a test.
    short = {"x-mock-tps": "20", "x-mock-tokens": "60"}
    assert await open_and_leave(sidecar, "drained", **short) == "streamed"
    assert await open_and_leave(sidecar, "refused", **short) == "too_many_streams"
    upstream = await mock.stats.wait_ended("drained", timeout=30)
    assert upstream.completed and not upstream.closed_early  # read to its end
    await wait_for(lambda: len(sidecar.tracker.finished) == 1, what="the drain's end")
    assert sidecar.tracker.finished[-1].meter.end_state == "drained"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + CHAT, headers={"x-mock-tps": "0"}, json={"stream": True}
        ) as response:
            assert response.status == 200  # the slot is back
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
    assert sidecar.client_connections.read_on == 0


async def test_a_detached_stream_gives_its_slot_back_when_it_is_stopped(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_concurrent_streams=1, **POLICIES["detach"])
    stream_id = ""
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + CHAT,
            headers={**LONG, "x-mock-request-id": "detached", **KEY},
            json={"stream": True},
        ) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            await read_events(response, until=lambda got: len(got) >= 2)
            response.close()
    await wait_for(lambda: read_on(sidecar) == 1, what="detached")
    assert await open_and_leave(sidecar, "refused") == "too_many_streams"
    async with aiohttp.ClientSession() as session:
        async with session.delete(
            sidecar.proxy_url + CHAT, headers={**KEY, STREAM_ID_HEADER: stream_id}
        ) as stopped:
            assert stopped.status == 204
    assert (await mock.stats.wait_ended("detached")).closed_early
    await wait_for(lambda: len(sidecar.tracker.finished) == 1, what="the stop's end")
    assert await open_and_leave(sidecar, "after") == "streamed"  # the slot is back


async def test_a_resume_of_a_stream_read_on_here_shares_its_slot(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    # One generation, one slot: its owner's resume is served while a new
    # stream is refused (the detached stream still fills the one slot).
    sidecar = await start_sidecar(
        mock.url, max_concurrent_streams=1, on_client_gone="detach", resume_window="5m"
    )
    tokens = {"x-mock-tps": "50", "x-mock-ttft": "0", "x-mock-tokens": "60"}
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + CHAT,
            headers={**tokens, "x-mock-request-id": "resumed", **KEY},
            json={"stream": True},
        ) as response:
            first = await read_events(response, until=lambda got: len(got) >= 3)
            response.close()
    await wait_for(lambda: read_on(sidecar) == 1, what="detached")
    assert await open_and_leave(sidecar, "refused") == "too_many_streams"
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + CHAT,
            headers={**KEY, "Last-Event-ID": first[-1].id or ""},
            json={"stream": True},
        ) as again:
            assert again.status == 200
            rest = await read_events(again)
    assert text_of(first + rest) == mock_text(60)
    assert len(mock.stats.records) == 1


async def test_streams_read_on_hold_places_under_max_client_connections(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    # No stream limit at all: the descriptor budget alone must still bound
    # the upstream connections that streams read on keep open.
    sidecar = await start_sidecar(
        mock.url, max_client_connections=LIMIT, on_client_gone="drain", request_header_timeout=0
    )
    got = [await open_and_leave(sidecar, f"place-{n}") for n in range(CLIENTS)]
    assert got == ["streamed"] * LIMIT + ["too_many_connections"] * (CLIENTS - LIMIT)
    assert generations_running(mock) == LIMIT
    places = sidecar.client_connections
    assert (places.open, places.read_on, places.held) == (0, LIMIT, LIMIT)
    refused = sidecar.metrics.refused.labels("too_many_connections")._value.get()
    assert refused == CLIENTS - LIMIT
    metrics = sidecar.metrics.render().decode()
    assert f"streamwarden_client_connections {float(LIMIT)}" in metrics
