"""A failure is never less visible through streamwarden than it is directly.

Where a format's clients raise on its in-band error event, that event is
how a cut reaches them (tests/faces/test_sdk_error_events.py). Where they do not
(a plain event stream, read here with ``httpx-sse`` as any generic SSE
client would, or ``EventSource``), the client's body ends abnormally after
the error event: no terminating chunk, as from an upstream that broke off.

Directly from the mock's plain stream, a reset is an error and the other
faults are silent (or hang); through the sidecar every fault is an error,
the reset included: before this rule it became a clean end after an
``event: error`` that such a client skips. The middleware likewise: an app
that raises mid-stream breaks its body directly, and through the
middleware too.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from middleware_apps import serve_in_process
from sidecars import StartSidecar
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import MockServer

FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "6"}
SETTINGS = {"upstream_idle_timeout": "300ms", "max_event_bytes": "64KiB"}
#: Each fault, what a generic client sees of it directly, and the code it gets through.
FAULTS = {
    "truncate-mid": ("silent", "stream_truncated"),
    "stall": ("hangs", "upstream_timeout"),
    "giant-event": ("silent", "event_too_large"),
    "reset": ("raises", "upstream_error"),
}


async def read_events(url: str, headers: dict[str, str]) -> tuple[list[Any], Exception | None]:
    """Read a plain event stream as a generic SSE client: its events, and what it raised."""
    events: list[Any] = []
    try:
        async with (
            httpx.AsyncClient(timeout=10.0) as client,
            aconnect_sse(client, "GET", url, headers=headers) as source,
        ):
            async for event in source.aiter_sse():
                events.append(event)
    except Exception as exc:  # what the client raised is the point
        return events, exc
    return events, None


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_generic_client_never_hears_less_of_a_fault_through_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar, fault: str
) -> None:
    headers = {**FAST, "x-mock-fault": fault, "x-mock-size": str(1 << 20)}
    direct, code = FAULTS[fault]
    if direct == "hangs":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await read_events(mock.url + "/sse", headers)
    else:
        _, raised = await read_events(mock.url + "/sse", headers)
        assert (raised is not None) == (direct == "raises"), repr(raised)

    sidecar = await start_sidecar(mock.url, **SETTINGS)
    events, raised = await read_events(sidecar.proxy_url + "/sse", headers)
    # The error event, for a client that listens for it, then a broken body.
    assert events and events[-1].event == "error" and code in events[-1].data
    assert isinstance(raised, httpx.RemoteProtocolError), repr(raised)


async def test_a_whole_generic_stream_still_ends_cleanly(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    direct, _ = await read_events(mock.url + "/sse", FAST)
    sidecar = await start_sidecar(mock.url, **SETTINGS)
    events, raised = await read_events(sidecar.proxy_url + "/sse", FAST)
    assert raised is None
    assert [e.data for e in events] == [e.data for e in direct] and len(events) == 6


async def _breaks_off(scope: Any, receive: Any, send: Any) -> None:
    """A plain event stream whose producer fails after two events."""
    if scope["type"] != "http":
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for n in range(2):
        await send({"type": "http.response.body", "body": b"data: %d\n\n" % n, "more_body": True})
    raise RuntimeError("the model server went away")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_an_app_that_breaks_off_breaks_its_body_through_the_middleware_too() -> None:
    async with serve_in_process(_breaks_off) as direct:
        events, raised = await read_events(direct + "/", {})
    assert [e.data for e in events] == ["0", "1"]
    assert isinstance(raised, httpx.RemoteProtocolError)  # directly: an error

    async with serve_in_process(StreamWardenMiddleware(_breaks_off)) as guarded:
        events, raised = await read_events(guarded + "/", {})
    assert [e.data for e in events[:2]] == ["0", "1"]
    assert events[-1].event == "error" and "upstream_error" in events[-1].data
    assert isinstance(raised, httpx.RemoteProtocolError), repr(raised)  # and through it
