"""The sidecar's five jobs on real streams: real SDKs, real sockets, a real mock upstream.

Each behaviour is first shown failing on a direct connection to the mock
(or through a naive proxy, where a direct connection has no such problem),
then shown fixed through the sidecar.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import anthropic
import httpx
import openai
import pytest
from aiohttp import web
from httpx_sse import aconnect_sse

from lockstep import Lockstep, lines_in_lockstep
from sidecars import StartSidecar
from streamwarden.core.relay import KEEPALIVE
from streamwarden.core.sse import SSEDecoder
from streamwarden.tools.mock import MockServer
from upstreams import ServeUpstream, port_of
from waiting import wait_for

CHAT = [{"role": "user", "content": "hi"}]


async def openai_stream(base_url: str, **headers: str) -> tuple[str, int | None]:
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="test", max_retries=0, default_headers=headers
    )
    text, usage = "", None
    try:
        stream = await client.chat.completions.create(
            model="mock",
            messages=CHAT,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
    finally:
        await client.close()
    return text, usage


async def anthropic_stream(base_url: str, **headers: str) -> str:
    client = anthropic.AsyncAnthropic(
        base_url=base_url, api_key="test", max_retries=0, default_headers=headers
    )
    text = ""
    try:
        stream = await client.messages.create(
            model="mock",
            max_tokens=100,
            messages=CHAT,
            stream=True,  # type: ignore[arg-type]
        )
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
    finally:
        await client.close()
    return text


FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "30"}


async def test_openai_sdk_streams_unchanged_through_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    direct = await openai_stream(mock.url, **FAST)
    proxied = await openai_stream(sidecar.proxy_url, **FAST)
    assert proxied == direct
    assert direct[1] == 30
    (record,) = sidecar.tracker.finished
    assert record.meter.end_state == "completed"
    assert record.dialect == "openai-chat"
    assert record.meter.tokens_generated == record.meter.tokens_delivered == 30


async def test_anthropic_sdk_streams_unchanged_through_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    direct = await anthropic_stream(mock.url, **FAST)
    assert direct
    assert await anthropic_stream(sidecar.proxy_url, **FAST) == direct


async def test_truncated_upstream_is_silent_direct_and_raises_through_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    cut = {**FAST, "x-mock-fault": "truncate"}
    # The problem: both SDKs hand back half an answer without a word.
    text, usage = await openai_stream(mock.url, **cut)
    assert text and usage is None
    assert await anthropic_stream(mock.url, **cut)
    # Through the sidecar both raise, carrying the code.
    with pytest.raises(openai.APIError) as caught:
        await openai_stream(sidecar.proxy_url, **cut)
    assert caught.value.code == "stream_truncated"
    with pytest.raises(anthropic.APIStatusError) as raised:
        await anthropic_stream(sidecar.proxy_url, **cut)
    assert "stream_truncated" in str(raised.value)
    states = [r.meter.end_state for r in sidecar.tracker.finished]
    assert states == ["upstream_truncated", "upstream_truncated"]


async def test_reset_upstream_is_a_connection_error_direct_and_an_api_error_through(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    reset = {**FAST, "x-mock-fault": "reset"}
    with pytest.raises(openai.APIConnectionError):
        await openai_stream(mock.url, **reset)
    with pytest.raises(openai.APIError) as caught:
        await openai_stream(sidecar.proxy_url, **reset)
    assert not isinstance(caught.value, openai.APIConnectionError)
    assert caught.value.code == "upstream_error"


# -- adversarial chunking ------------------------------------------------------

ADVERSARIAL = (
    'data: {"choices":[{"delta":{"content":"naïve café 日本語 😀"}}]}\r\n\r\n'
    "event: note\r\nid: 7\r\ndata: line one\r\ndata: line two 😀\r\n\r\n"
    ": a comment\n\n"
    'data: {"choices":[{"delta":{"content":"— end"}}]}\r\n\r\n'
    "data: [DONE]\r\n\r\n"
).encode()


@pytest.fixture
async def adversarial_upstream(serve_upstream: ServeUpstream) -> str:
    """Writes the stream in pieces cut inside multi-byte characters and CRLFs."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        cuts = sorted(
            {i + 1 for i, b in enumerate(ADVERSARIAL) if b in (0x0D, 0xC3, 0xE6, 0xF0)}
            | {i + 2 for i, b in enumerate(ADVERSARIAL) if b in (0xE6, 0xF0)}
        )
        start = 0
        for cut in [*cuts, len(ADVERSARIAL)]:
            await response.write(ADVERSARIAL[start:cut])
            await asyncio.sleep(0.002)  # separate TCP segments
            start = cut
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return await serve_upstream(app)


async def sse_events(url: str) -> list[tuple[str, str, str]]:
    async with (
        httpx.AsyncClient() as client,
        aconnect_sse(client, "POST", url + "/v1/chat/completions") as source,
    ):
        return [(e.event, e.data, e.id) async for e in source.aiter_sse()]


async def test_httpx_sse_sees_the_same_events_under_adversarial_chunking(
    adversarial_upstream: str, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(adversarial_upstream)
    direct = await sse_events(adversarial_upstream)
    assert [data for _, data, _ in direct if data][1] == "line one\nline two 😀"
    assert await sse_events(sidecar.proxy_url) == direct
    (record,) = sidecar.tracker.finished
    assert record.meter.end_state == "completed"


# -- keep-alives and trickling -------------------------------------------------


async def test_keepalives_arrive_while_the_upstream_is_silent_and_never_inside_an_event(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    # The upstream goes silent after 2 tokens until its client leaves: every
    # keep-alive the client sees is one the sidecar wrote into that silence.
    # The direct stream, open all along, is the baseline: it gets nothing.
    stall = {**FAST, "x-mock-fault": "stall", "x-mock-fault-after": "2"}
    url = "/v1/chat/completions"
    sidecar = await start_sidecar(mock.url, keepalive_interval="200ms")
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        direct = await session.post(
            mock.url + url, headers={**stall, "x-mock-request-id": "direct"}, json={"stream": True}
        )
        direct_body = b""
        while direct_body.count(b'"content":"') < 3:  # the role chunk and 2 tokens
            direct_body += await direct.content.readany()
        reads: list[bytes] = []
        async with session.post(
            sidecar.proxy_url + url,
            headers={**stall, "x-mock-request-id": "proxied"},
            json={"stream": True},
        ) as proxied:
            while b"".join(reads).count(KEEPALIVE) < 3:
                reads.append(await proxied.content.readany())
            upstream = mock.stats.get("proxied")
            assert upstream is not None and upstream.tokens_generated == 2 and not upstream.ended
        direct_body += direct.content.read_nowait()  # and what came while the proxied got 3
        direct.close()
    assert KEEPALIVE not in direct_body and direct_body.count(b'"content":"') == 3
    # Never inside an event: every read decodes on its own to whole events.
    assert all(chunk.endswith(b"\n\n") for chunk in reads), reads
    # Spaced by the interval, not a flood: no more keep-alives than intervals
    # in the silence (the mock's record: its start to its close), which a
    # busy machine only lengthens.
    upstream = await mock.stats.wait_ended("proxied")
    assert upstream.closed_at is not None
    silence = upstream.closed_at - upstream.started_at
    assert b"".join(reads).count(KEEPALIVE) <= silence / 0.2 + 1


async def test_curl_sees_tokens_arrive_one_by_one(start_sidecar: StartSidecar) -> None:
    # The upstream writes each token only once curl has printed the one before:
    # a sidecar that held tokens back would never get the next one.
    async with Lockstep(tokens=10) as upstream:
        sidecar = await start_sidecar(upstream.url)
        process = await asyncio.create_subprocess_exec(
            "curl",
            "-sN",
            "-X",
            "POST",
            sidecar.proxy_url + "/v1/chat/completions",
            "-H",
            "content-type: application/json",
            "-d",
            '{"stream": true}',
            stdout=asyncio.subprocess.PIPE,
        )
        assert process.stdout is not None
        try:
            async with asyncio.timeout(10):
                lines = await lines_in_lockstep(process.stdout, upstream)
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()
    assert sum(b'"content":"t' in line for line in lines) == 10
    assert lines[-2:] == [b"data: [DONE]\n", b"\n"]


# -- cancellation --------------------------------------------------------------


def raw_request(port: int, path: str, headers: dict[str, str]) -> bytes:
    body = b'{"stream": true}'
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def leave_in_silence(port: int, mock: MockServer, request_id: str) -> None:
    """Open a stream, read until the upstream is silent for good, reset the connection."""
    headers = {
        **FAST,
        "x-mock-fault": "stall",
        "x-mock-fault-after": "3",
        "x-mock-request-id": request_id,
    }
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw_request(port, "/v1/chat/completions", headers))
    received = b""
    async with asyncio.timeout(5):
        while received.count(b'"content":"') < 4:  # the role chunk's and 3 tokens
            received += await reader.read(65536)
    # The client has the 3 tokens: the sidecar relayed them and waits on an
    # upstream that is silent from here until someone closes it.
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x00" * 8)
    writer.close()


async def test_client_leaving_closes_the_silent_upstream(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    # Silent for ever: only the client's leaving, passed on, can end each
    # upstream request. How fast it is passed on is bench/'s (scenario e).
    sidecar = await start_sidecar(mock.url)
    for i in range(10):
        await leave_in_silence(sidecar.proxy_port, mock, f"cancel-{i}")
        record = await mock.stats.wait_ended(f"cancel-{i}", timeout=10)
        assert record.closed_early and record.closed_at is not None
        assert record.tokens_generated == 3  # it stopped generating
    await wait_for(lambda: len(sidecar.tracker.finished) == 10, what="every stream recorded")
    states = {r.meter.end_state for r in sidecar.tracker.finished}
    assert states == {"client_cancelled"}
    assert all(r.meter.cancel_propagation is not None for r in sidecar.tracker.finished)
    assert not sidecar.tracker.active


async def test_a_naive_proxy_leaves_the_silent_upstream_running(
    mock: MockServer, start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    """The baseline: an aiohttp proxy without handler cancellation never notices."""

    async def naive(request: web.Request) -> web.StreamResponse:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                mock.url + request.path, headers=request.headers, data=await request.read()
            ) as upstream,
        ):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", naive)
    # aiohttp's default is handler_cancellation=False.
    naive_url = await serve_upstream(app, shutdown_timeout=0.1)
    await leave_in_silence(port_of(naive_url), mock, "naive")
    # The same client through the sidecar, after it: its upstream is closed,
    # while the naive proxy's, left first, is still open.
    sidecar = await start_sidecar(mock.url)
    await leave_in_silence(sidecar.proxy_port, mock, "sidecar")
    await mock.stats.wait_ended("sidecar", timeout=10)
    record = mock.stats.get("naive")
    assert record is not None and not record.ended  # still generating for nobody


# -- faults --------------------------------------------------------------------

FAULTS = [
    ("truncate", "upstream_truncated", "stream_truncated"),
    ("truncate-mid", "upstream_truncated", "stream_truncated"),
    ("reset", "upstream_error", "upstream_error"),
    ("broken-chunked", "upstream_error", "upstream_error"),
    ("stall", "upstream_timeout", "upstream_timeout"),
    ("giant-event", "limit_exceeded", "event_too_large"),
    ("garbage", "upstream_truncated", "stream_truncated"),  # bytes, no line end, then EOF
    (None, "completed", None),
    ("keepalive-pings", "completed", None),
]
PATHS = {
    "openai-chat": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "openai-responses": "/v1/responses",
    "gemini": "/v1beta/models/mock:streamGenerateContent?alt=sse",
    "ndjson": "/api/chat",
}


@pytest.mark.parametrize("dialect", sorted(PATHS))
@pytest.mark.parametrize(("fault", "end_state", "code"), FAULTS, ids=[str(f[0]) for f in FAULTS])
async def test_each_fault_ends_with_the_right_state_and_code(
    mock: MockServer,
    start_sidecar: StartSidecar,
    dialect: str,
    fault: str | None,
    end_state: str,
    code: str | None,
) -> None:
    sidecar = await start_sidecar(mock.url, upstream_idle_timeout="300ms", max_event_bytes="256KiB")
    headers = {**FAST, "x-mock-tokens": "6", "x-mock-size": str(1 << 20)}
    if fault:
        headers["x-mock-fault"] = fault
    if fault == "keepalive-pings" and dialect == "ndjson":
        pytest.skip("NDJSON has no comment syntax for pings")
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            sidecar.proxy_url + PATHS[dialect], headers=headers, json={"stream": True}
        ) as response,
    ):
        assert response.status == 200
        body = await response.read()  # a clean end: no exception from the client
    await wait_for(lambda: bool(sidecar.tracker.finished), what="the stream recorded")
    (record,) = sidecar.tracker.finished
    assert record.dialect == dialect
    assert record.meter.end_state == end_state
    assert record.meter.error_code == code
    if code is not None:
        assert code.encode() in body
        tail = body.rsplit(b"\n\n", 2)[-2] if dialect != "ndjson" else body.splitlines()[-1]
        assert code.encode() in tail  # the error is the last thing in the body
    if dialect != "ndjson":
        SSEDecoder().feed(body)  # well-formed event stream
    else:
        for line in body.splitlines():
            json.loads(line)


# -- early headers -------------------------------------------------------------


async def test_early_headers_keep_a_long_prefill_alive(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    slow = {**FAST, "x-mock-fault": "slow-headers", "x-mock-delay": "1.5"}
    url = "/v1/chat/completions"
    sidecar = await start_sidecar(mock.url, early_headers_after="100ms", keepalive_interval="100ms")
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        # The problem: a long prefill sends nothing at all, not even headers.
        direct = asyncio.create_task(
            session.post(mock.url + url, headers={**slow, "x-mock-request-id": "direct"}, json={})
        )
        async with session.post(
            sidecar.proxy_url + url,
            headers={**slow, "x-mock-request-id": "proxied"},
            json={"stream": True},
        ) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            body = b""
            while body.count(KEEPALIVE) < 3:
                body += await r.content.readany()
            # All this before the upstream answered either request.
            for request_id in ("direct", "proxied"):
                record = mock.stats.get(request_id)
                assert record is not None and record.status is None
            assert not direct.done()
            body += await r.read()
        (await direct).close()
    assert body.startswith(KEEPALIVE * 3)
    assert body.endswith(b"data: [DONE]\n\n")
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"


@pytest.fixture
async def slow_rate_limited_upstream(
    serve_upstream: ServeUpstream,
) -> tuple[str, asyncio.Event]:
    """Thinks until released, then answers 429 (as a busy provider does after queueing)."""
    released = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        await released.wait()
        return web.json_response({"error": {"message": "rate limited"}}, status=429)

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    return await serve_upstream(app, shutdown_timeout=0.1), released


async def test_early_headers_turn_a_later_error_status_into_an_error_event(
    slow_rate_limited_upstream: tuple[str, asyncio.Event], start_sidecar: StartSidecar
) -> None:
    url, released = slow_rate_limited_upstream
    sidecar = await start_sidecar(url, early_headers_after="100ms")

    async def release_after_the_early_headers() -> None:
        # The 429 comes once the sidecar has committed its stream: with the
        # upstream's answer held, only the early headers open one.
        await wait_for(lambda: bool(sidecar.tracker.active), what="the early headers")
        released.set()

    releasing = asyncio.create_task(release_after_the_early_headers())
    with pytest.raises(openai.APIError) as caught:
        await openai_stream(sidecar.proxy_url)
    await releasing
    assert caught.value.code == "upstream_error"
    assert "HTTP 429" in caught.value.message


async def test_early_headers_leave_non_streaming_requests_alone(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, early_headers_after="50ms")
    async with aiohttp.ClientSession() as session:
        async with session.post(
            sidecar.proxy_url + "/v1/chat/completions",
            json={"stream": False},
            headers={"x-mock-ttft": "0.2", "x-mock-tps": "0"},
        ) as response:
            assert response.headers["Content-Type"].startswith("application/json")
            assert (await response.json())["object"] == "chat.completion"


# -- concurrency limit ---------------------------------------------------------


async def test_stream_limit_refuses_new_streams_with_retry_after_and_spares_the_open_ones(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_concurrent_streams=2)
    slow = {"x-mock-tps": "20", "x-mock-ttft": "0", "x-mock-tokens": "10"}
    url = sidecar.proxy_url + "/v1/chat/completions"

    async def stream() -> bytes:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, headers=slow, json={"stream": True}) as response:
                assert response.status == 200
                return await response.read()

    open_streams = [asyncio.create_task(stream()) for _ in range(2)]
    await wait_for(lambda: len(sidecar.tracker.active) == 2, what="both streams open")
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=slow, json={"stream": True}) as response:
            assert response.status == 503
            assert response.headers["Retry-After"] == "1"
            assert (await response.json())["error"]["code"] == "too_many_streams"
        # Requests that do not ask for a stream still pass.
        async with session.post(
            url, headers={"x-mock-ttft": "0", "x-mock-tps": "0"}, json={"stream": False}
        ) as response:
            assert response.status == 200
    for body in await asyncio.gather(*open_streams):
        assert body.endswith(b"data: [DONE]\n\n")  # untouched
    assert await stream()  # capacity is back
