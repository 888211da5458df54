"""The middleware under real ASGI servers: uvicorn, hypercorn and granian, each in a subprocess.

Every app here runs behind a real server on a loopback port, and every
client is a real socket. Each behaviour is shown first without the
middleware (``/plain/...``) where the stack has the problem, then through
it (``/guarded/...``). The apps are in :mod:`middleware_apps`.

Timing: the app writes ``time.monotonic()`` in its generator's ``finally``;
the test closes its socket and reads its own ``time.monotonic()``; both are
CLOCK_MONOTONIC, shared across processes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from broken import read_broken
from middleware_apps import KEEPALIVE, SERVERS, ServerProcess, running
from streamwarden.core.relay import KEEPALIVE as KEEPALIVE_FRAME
from waiting import wait_for

# How long a baseline is watched to show that nothing happens.
BASELINE_WINDOW = 0.5


@pytest.fixture(scope="module", params=SERVERS)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with running(request.param, tmp_path_factory.mktemp(request.param)) as process:
        yield process


# -- helpers -----------------------------------------------------------------------


async def disconnect_mid_stream(server: ServerProcess, path: str) -> tuple[str, float]:
    """Open ``path``, read the first event, close the socket once the app awaits its
    silent provider; return (id, closed at)."""
    request_id = uuid.uuid4().hex
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(
            f"GET {path}?id={request_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        await writer.drain()
        seen = b""
        async with asyncio.timeout(5):
            while b"data: first" not in seen:
                chunk = await reader.read(4096)
                assert chunk, f"the server closed the stream early: {seen!r}"
                seen += chunk
        waiting = server.finally_dir / f"{request_id}.waiting"
        await wait_for(waiting.exists, what=f"{path}: the app waiting on its provider")
    finally:
        writer.close()
    closed_at = time.monotonic()
    return request_id, closed_at


async def finally_after(
    server: ServerProcess, request_id: str, closed_at: float, window: float
) -> float | None:
    """Seconds from the disconnect to the app's ``finally``, or None if it did not run in time."""
    path = server.finally_dir / request_id
    deadline = closed_at + window
    while time.monotonic() < deadline:
        try:
            return float(path.read_text()) - closed_at
        except (FileNotFoundError, ValueError):
            await asyncio.sleep(0.001)
    return None


async def timed_chunks(url: str) -> list[tuple[float, bytes]]:
    """Every body chunk of a stream with its arrival time, relative to the first one."""
    arrivals: list[tuple[float, bytes]] = []
    async with httpx.AsyncClient(timeout=10.0) as client, client.stream("GET", url) as response:
        assert response.status_code == 200
        async with asyncio.timeout(10):
            async for chunk in response.aiter_raw():
                arrivals.append((time.monotonic(), chunk))
    first = arrivals[0][0]
    return [(at - first, chunk) for at, chunk in arrivals]


def keepalive_times(arrivals: list[tuple[float, bytes]]) -> list[float]:
    return [at for at, chunk in arrivals for _ in range(chunk.count(KEEPALIVE_FRAME))]


def report(server: ServerProcess, what: str, value: str) -> None:
    print(f"[{server.server}] {what}: {value}")


# -- cancellation --------------------------------------------------------------------


@pytest.mark.parametrize("app", ["raw", "starlette", "sse-starlette"])
async def test_disconnect_runs_the_generators_finally_at_once(
    server: ServerProcess, app: str
) -> None:
    request_id, closed_at = await disconnect_mid_stream(server, f"/guarded/{app}/silent")
    latency = await finally_after(server, request_id, closed_at, window=2.0)
    assert latency is not None, "the app kept waiting on its silent provider"
    # The silent provider never writes again, so a finally within the window is
    # the disconnect's doing; how soon is a measurement (reported), not a pass mark
    # a busy CI machine can miss (it did: a granian run under load).
    report(server, f"{app}: disconnect -> finally", f"{latency * 1000:.1f} ms")


async def test_without_the_middleware_a_raw_app_waits_on_its_silent_provider(
    server: ServerProcess,
) -> None:
    request_id, closed_at = await disconnect_mid_stream(server, "/plain/raw/silent")
    assert await finally_after(server, request_id, closed_at, BASELINE_WINDOW) is None


async def test_without_the_middleware_starlette_at_spec_2_4_waits_and_below_it_does_not(
    server: ServerProcess,
) -> None:
    # At spec 2.4 StreamingResponse stops listening for http.disconnect...
    request_id, closed_at = await disconnect_mid_stream(server, "/plain-2.4/starlette/silent")
    assert await finally_after(server, request_id, closed_at, BASELINE_WINDOW) is None
    # ...below it, it listens: the stack already does the job there (and the test can tell).
    request_id, closed_at = await disconnect_mid_stream(server, "/plain/starlette/silent")
    assert await finally_after(server, request_id, closed_at, window=2.0) is not None


@pytest.mark.parametrize("app", ["raw", "starlette"])
async def test_disconnect_at_spec_2_4_runs_the_finally_at_once(
    server: ServerProcess, app: str
) -> None:
    request_id, closed_at = await disconnect_mid_stream(server, f"/guarded-2.4/{app}/silent")
    latency = await finally_after(server, request_id, closed_at, window=2.0)
    assert latency is not None
    report(server, f"{app} at spec 2.4: disconnect -> finally", f"{latency * 1000:.1f} ms")


async def test_a_server_that_only_fails_send_is_noticed_at_the_next_keepalive(
    server: ServerProcess,
) -> None:
    # No http.disconnect ever arrives; the keep-alive write is what finds the closed
    # connection, so the app is cancelled within one keep-alive interval.
    request_id, closed_at = await disconnect_mid_stream(
        server, "/guarded-sendonly/starlette/silent"
    )
    latency = await finally_after(server, request_id, closed_at, window=2.0)
    # Found at all (the silent provider never writes again, and no disconnect
    # arrives): the keep-alive's write did it. How soon is a measurement
    # (about one interval), reported, not a pass mark a busy machine can miss.
    assert latency is not None
    report(server, "send-error-only server: disconnect -> finally", f"{latency * 1000:.1f} ms")


# -- keep-alives ---------------------------------------------------------------------


async def test_keepalives_arrive_on_time_while_the_app_is_quiet(server: ServerProcess) -> None:
    quiet = 1.0
    plain, guarded = await asyncio.gather(
        timed_chunks(f"{server.url}/plain/raw/quiet?s={quiet}"),
        timed_chunks(f"{server.url}/guarded/raw/quiet?s={quiet}"),
    )
    # Without: a full second of silence, which an idle-timeout intermediary cuts.
    assert keepalive_times(plain) == []
    assert max(b - a for (a, _), (b, _) in itertools.pairwise(plain)) >= quiet - 0.05
    # With: one keep-alive per interval, counted from the last write.
    times = keepalive_times(guarded)
    # At most one per interval of the quiet second (a timer never fires early);
    # at least two, however late a busy machine runs them.
    assert 2 <= len(times) <= 5, times
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    report(server, "keep-alive gaps", ", ".join(f"{g * 1000:.0f} ms" for g in gaps))
    assert all(gap >= KEEPALIVE - 0.03 for gap in gaps), gaps  # never sooner than the interval
    body = b"".join(chunk for _, chunk in guarded)
    assert body.replace(KEEPALIVE_FRAME, b"") == b"data: first\n\ndata: last\n\n"


@pytest.mark.parametrize("app", ["raw", "starlette"])
async def test_keepalives_never_split_an_event_written_in_two_sends(
    server: ServerProcess, app: str
) -> None:
    pause = 0.7
    plain, guarded = await asyncio.gather(
        timed_chunks(f"{server.url}/plain/{app}/split?pause={pause}"),
        timed_chunks(f"{server.url}/guarded/{app}/split?pause={pause}"),
    )
    whole = b'data: first\n\ndata: {"half": "two"}\n\ndata: last\n\n'
    # Without: the half event goes out at once, then nothing for the whole pause.
    assert b"".join(c for _, c in plain) == whole
    assert keepalive_times(plain) == []
    # With: keep-alives during the pause, each between two whole events; the
    # half event is held until its second half arrives.
    body = b"".join(c for _, c in guarded)
    assert body.replace(KEEPALIVE_FRAME, b"") == whole
    assert len(keepalive_times(guarded)) >= 2  # three in the pause; fewer if timers run late
    for index in _find_all(body, KEEPALIVE_FRAME):
        assert index == 0 or body[:index].endswith(b"\n\n"), body
    half_at = next(at for at, chunk in guarded if b'{"half":' in chunk)
    assert half_at >= pause - 0.05
    assert b'data: {"half": "two"}\n\n' in next(c for _, c in guarded if b'{"half":' in c)


def _find_all(data: bytes, needle: bytes) -> list[int]:
    found, start = [], 0
    while (index := data.find(needle, start)) >= 0:
        found.append(index)
        start = index + len(needle)
    return found


async def test_streams_and_plain_responses_share_one_keepalive_connection(
    server: ServerProcess,
) -> None:
    # After a relayed stream the connection serves the next request normally.
    paths = ["raw/quiet?s=0", "starlette/hello", "starlette/quiet?s=0", "sse-starlette/done"]
    async with httpx.AsyncClient(timeout=5.0) as client:
        for path in paths * 2:
            response = await client.get(f"{server.url}/guarded/{path}")
            assert response.status_code == 200
            assert response.content.startswith(b"hello" if "hello" in path else b"data: first")
        pool = client._transport._pool  # type: ignore[attr-defined]
        assert len(pool.connections) == 1


# -- endings ---------------------------------------------------------------------------


async def test_an_app_that_breaks_off_breaks_a_generic_body_through_the_middleware_too(
    server: ServerProcess,
) -> None:
    # Directly, the server drops the connection of an app that raises mid-body.
    async with httpx.AsyncClient(timeout=10.0) as client:
        direct = await read_broken(client, "GET", f"{server.url}/plain/raw/raise")
        # Through the middleware: the error event for a client that listens for
        # it, then the body broken as well (its response left unfinished): never
        # a clean end, which a generic client would take for a whole answer.
        guarded = await read_broken(client, "GET", f"{server.url}/guarded/raw/raise")
    assert b"upstream_error" not in direct
    assert b"upstream_error" in guarded
