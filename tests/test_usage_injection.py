"""Usage injection: exact token counts from an upstream that sends usage only on request.

OpenAI's API, vLLM and others stream a token count only when the request
sets ``stream_options.include_usage``. Without it the sidecar can only
estimate; with ``usage_injection: auto`` it asks for the count itself and
takes back what that changes, so the client's bytes stay as they were.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from streamwarden.mock import MockServer
from streamwarden.sidecar import Sidecar
from waiting import wait_for

StartSidecar = Callable[..., Awaitable[Sidecar]]
CHAT = "/v1/chat/completions"
TOKENS = 12
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
MOCK = {"x-mock-tokens": str(TOKENS), "x-mock-tps": "0", "x-mock-ttft": "0"}


def normalized(raw: bytes) -> bytes:
    # The mock stamps each answer with the second it was made.
    return re.sub(rb'"created":\d+', b'"created":0', raw)


async def raw_stream(url: str, body: dict[str, Any], request_id: str) -> bytes:
    async with httpx.AsyncClient() as client:
        headers = {**MOCK, "x-mock-request-id": request_id}
        response = await client.post(url + CHAT, json=body, headers=headers)
        return response.content


async def meter_of(sidecar: Sidecar, count: int) -> Any:
    await wait_for(lambda: len(sidecar.tracker.finished) == count)
    return sidecar.tracker.finished[-1].meter


async def test_without_injection_the_tokens_are_estimated(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, usage_injection="off")
    await raw_stream(sidecar.proxy_url, REQUEST, "plain")
    meter = await meter_of(sidecar, 1)
    assert meter.tokens_source == "estimated"


async def test_with_injection_the_count_is_the_providers_and_the_bytes_are_unchanged(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    direct = await raw_stream(mock.url, REQUEST, "same")
    sidecar = await start_sidecar(mock.url)  # usage_injection: auto is the default
    through = await raw_stream(sidecar.proxy_url, REQUEST, "same")
    assert b'"usage"' not in direct  # the client never asked for usage
    assert normalized(through) == normalized(direct)  # and never sees any
    meter = await meter_of(sidecar, 1)
    assert meter.tokens_source == "provider"
    assert meter.tokens_generated == TOKENS
    upstream = mock.stats.records[-1]
    assert upstream.tokens_generated == TOKENS
    metrics = sidecar.metrics.render().decode()
    assert (
        'streamwarden_tokens_generated_total{dialect="openai-chat",source="provider"} 12.0'
        in metrics
    )


async def test_the_openai_sdk_sees_the_same_chunks_with_and_without_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)

    async def chunks(base: str) -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={**MOCK, "x-mock-request-id": "sdk"},
        )
        got = [chunk.model_dump(exclude={"created"}) async for chunk in stream]
        await client.close()
        return got

    assert await chunks(sidecar.proxy_url) == await chunks(mock.url)
    assert (await meter_of(sidecar, 1)).tokens_source == "provider"


async def test_a_client_that_asked_for_usage_still_gets_it(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    asked = {**REQUEST, "stream_options": {"include_usage": True}}
    direct = await raw_stream(mock.url, asked, "asked")
    sidecar = await start_sidecar(mock.url)
    through = await raw_stream(sidecar.proxy_url, asked, "asked")
    assert b'"choices":[],' in through and b'"usage":null' in through
    assert normalized(through) == normalized(direct)


class RecordingUpstream:
    """Records each request body; answers like vLLM (or, ``old``, like vLLM before 0.5)."""

    def __init__(self, *, old: bool = False, refuse: bool = False) -> None:
        self.old = old
        #: Answer every request 400 for a reason of its own (not the option).
        self.refuse = refuse
        self.bodies: list[bytes] = []
        self.lengths: list[str | None] = []
        self.app = web.Application()
        self.app.router.add_post(CHAT, self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.lengths.append(request.headers.get("Content-Length"))
        try:
            sent = json.loads(body)
        except ValueError:
            sent = {}
        usage = isinstance(sent, dict) and bool(sent.get("stream_options"))
        if self.refuse:
            return web.json_response({"error": {"message": "model not found"}}, status=400)
        if usage and self.old:
            error = {"object": "error", "message": "stream_options: extra fields not permitted"}
            return web.json_response(error, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ("a", "b", "c"):
            chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": token}}]}
            if usage:
                chunk["usage"] = None
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if usage:
            final = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1}}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[RecordingUpstream], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(upstream: RecordingUpstream) -> str:
        runner = web.AppRunner(upstream.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_upstream_receives_the_body_with_the_option_added_and_its_length(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream))
    sent = b'{"model": "m", "stream": true, "stream_options": {"x": 1}, "messages": []}'
    async with httpx.AsyncClient() as client:
        response = await client.post(
            sidecar.proxy_url + CHAT, content=sent, headers={"Content-Type": "application/json"}
        )
    expected = (
        b'{"model":"m","stream":true,"stream_options":{"x":1,"include_usage":true},"messages":[]}'
    )
    assert upstream.bodies == [expected]
    assert upstream.lengths == [str(len(expected))]
    assert b"usage" not in response.content and response.content.count(b"data: ") == 4
    assert (await meter_of(sidecar, 1)).tokens_generated == 3


@pytest.mark.parametrize(
    "sent",
    [
        b'not json at all, but asking for a stream: "stream": true',
        b'[{"stream": true}]',  # JSON, not an object
        b'{"stream": true, "stream_options": "odd"}',
    ],
    ids=["not-json", "not-an-object", "odd-stream-options"],
)
async def test_bodies_it_cannot_rewrite_go_unchanged(
    serve: Callable[[RecordingUpstream], Awaitable[str]],
    start_sidecar: StartSidecar,
    sent: bytes,
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream))
    async with httpx.AsyncClient() as client:
        await client.post(sidecar.proxy_url + CHAT, content=sent)
    assert upstream.bodies == [sent]


async def test_a_body_over_the_bound_goes_unchanged_and_whole(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream), usage_injection_max_body_bytes="1KiB")
    big = json.dumps({"stream": True, "messages": [{"content": "x" * 5000}]}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: read to the bound
        for start in range(0, len(big), 700):
            yield big[start : start + 700]

    async with httpx.AsyncClient() as client:
        await client.post(sidecar.proxy_url + CHAT, content=chunked())
        await client.post(sidecar.proxy_url + CHAT, content=big)
    assert upstream.bodies == [big, big]


async def test_an_upstream_that_refuses_the_option_gets_the_request_unchanged_and_is_remembered(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream(old=True)
    sidecar = await start_sidecar(await serve(upstream))
    sent = json.dumps(REQUEST).encode()
    async with httpx.AsyncClient() as client:
        first = await client.post(sidecar.proxy_url + CHAT, content=sent)
        second = await client.post(sidecar.proxy_url + CHAT, content=sent)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content and first.content.endswith(b"data: [DONE]\n\n")
    # Injected once, refused, sent again unchanged; then left alone.
    assert [b"include_usage" in body for body in upstream.bodies] == [True, False, False]
    assert upstream.bodies[1:] == [sent, sent]


async def test_another_400_reaches_the_client_as_it_came(
    start_sidecar: StartSidecar, serve: Callable[[RecordingUpstream], Awaitable[str]]
) -> None:
    upstream = RecordingUpstream(refuse=True)
    sidecar = await start_sidecar(await serve(upstream))
    async with httpx.AsyncClient() as client:
        response = await client.post(sidecar.proxy_url + CHAT, json=REQUEST)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "model not found"}}
    assert len(upstream.bodies) == 1  # not sent twice: the option was not the problem


def test_a_usage_only_chunk_without_a_completion_count_is_hidden_too() -> None:
    from streamwarden.relay import Limits, Relay

    relay = Relay(
        Limits(15.0, 60.0, 1800.0, 1 << 20),
        started_at=0.0,
        now=0.0,
        path=CHAT,
        content_type="text/event-stream",
        headers={},
        injected_usage=True,
    )
    assert relay.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n', 0.1) == b""
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    assert relay.feed(chunk, 0.2) == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
