"""``early_headers_after`` in the middleware: head and keep-alives before the app starts.

A Starlette app under a real uvicorn on loopback waits on an event the test
holds (its provider's prefill) before it starts its ``StreamingResponse``.
Without streamwarden its client gets nothing, not even headers, all that
while; a load balancer with an idle timeout cuts it. Through the middleware
the client has ``200 text/event-stream`` and keep-alives while the app
waits, then the app's events; an app that answers with an error instead
gets the dialect's error event, which the openai SDK raises on, as in the
sidecar (``tests/sidecar/test_sidecar_streams.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from middleware_apps import serve_in_process
from streamwarden.middleware import StreamWardenMiddleware
from waiting import wait_for

CHAT = "/v1/chat/completions"
KEEPALIVE = b": keep-alive\n\n"
#: The middleware's settings here: the head after 100 ms, a keep-alive every 200 ms.
EARLY = {"early_headers_after": "100ms", "keepalive_interval": "200ms"}


class Provider:
    """The app's provider: it says when the app waits on it; the test lets it answer."""

    def __init__(self, answer: str = "stream") -> None:
        #: "stream": an event stream; "fail": 500 JSON, as a provider error passed on.
        self.answer = answer
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()
        #: The app's handler got out of its wait (its answer came, or it was stopped).
        self.unwound = asyncio.Event()


def chat_app(provider: Provider) -> Starlette:
    async def chat(request: Request) -> Response:
        asked = json.loads(await request.body())
        provider.waiting.set()
        try:
            await provider.release.wait()  # the prefill: the app has nothing to send yet
        finally:
            provider.unwound.set()
        if provider.answer == "fail":
            return JSONResponse({"error": {"message": "the provider failed"}}, status_code=500)
        if not asked.get("stream"):
            return JSONResponse({"choices": [{"message": {"content": "hello"}}]})

        async def events() -> AsyncIterator[bytes]:
            for word in ("hello", " world"):
                chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"x-answered-by": "app"}
        )

    return Starlette(routes=[Route(CHAT, chat, methods=["POST"])])


class Reader:
    """A streaming client that notes when the head and each chunk arrive."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self.headers: httpx.Headers | None = None
        self.received = b""
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with self._client.stream("POST", CHAT, json={"stream": True}) as response:
            self.headers = response.headers
            async for chunk in response.aiter_raw():
                self.received += chunk


async def test_a_waiting_app_sends_nothing_without_and_head_and_keepalives_with() -> None:
    # The problem: while the app awaits its provider, its client has nothing at all.
    provider = Provider()
    async with serve_in_process(chat_app(provider)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reader = Reader(client)
            async with asyncio.timeout(10):
                await provider.waiting.wait()
            # Bounded wait for an absence: the time the middleware below needs
            # for its head and a keep-alive, twice over.
            await asyncio.wait({reader.task}, timeout=0.6)
            assert reader.headers is None and reader.received == b""
            provider.release.set()
            await reader.task
    # Through the middleware: head and keep-alives while the app still waits.
    provider = Provider()
    guarded = StreamWardenMiddleware(chat_app(provider), **EARLY)
    async with serve_in_process(guarded) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reader = Reader(client)
            await wait_for(lambda: KEEPALIVE in reader.received, what="a keep-alive")
            assert not provider.unwound.is_set()  # the app still waits on its provider
            assert reader.headers is not None
            assert reader.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert "no-transform" in reader.headers["cache-control"]
            assert "x-answered-by" not in reader.headers  # the head is ours, not the app's
            provider.release.set()
            async with asyncio.timeout(10):
                await reader.task
    body = reader.received
    assert body.startswith(KEEPALIVE)
    assert b'"content": "hello"' in body and b'"content": " world"' in body
    assert body.endswith(b"data: [DONE]\n\n")
    await wait_for(lambda: bool(guarded.streams.finished), what="the stream's record")
    (record,) = guarded.streams.finished
    assert record.meter.end_state == "completed"
    assert record.dialect == "openai-chat"  # from the path: the head was ours


async def test_an_app_answering_an_error_after_the_early_head_gives_the_error_event() -> None:
    provider = Provider(answer="fail")
    guarded = StreamWardenMiddleware(chat_app(provider), **EARLY)
    async with serve_in_process(guarded) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)

        async def consume() -> list[str]:
            stream = await client.chat.completions.create(model="m", messages=[], stream=True)
            return [c.choices[0].delta.content or "" async for c in stream if c.choices]

        consuming = asyncio.create_task(consume())
        # The head is out (the SDK's create() returned) before the app answers.
        await wait_for(lambda: bool(guarded.streams.active), what="the early stream open")
        provider.release.set()
        with pytest.raises(openai.APIError) as caught:
            async with asyncio.timeout(10):
                await consuming
    assert caught.value.code == "upstream_error"
    assert "HTTP 500 (application/json)" in caught.value.message
    await wait_for(lambda: bool(guarded.streams.finished), what="the stream's record")
    assert guarded.streams.finished[-1].meter.end_state == "upstream_error"


async def test_the_error_event_is_the_dialects_own() -> None:
    provider = Provider(answer="fail")
    guarded = StreamWardenMiddleware(chat_app(provider), **EARLY)
    async with serve_in_process(guarded) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reader = Reader(client)
            await wait_for(lambda: reader.headers is not None, what="the early head")
            provider.release.set()
            async with asyncio.timeout(10):
                await reader.task
    assert reader.headers["content-type"].startswith("text/event-stream")
    (last,) = [line for line in reader.received.split(b"\n") if line.startswith(b"data: ")]
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_error"
    assert b"the provider failed" not in reader.received  # the app's answer is not relayed


async def test_a_client_leaving_during_the_wait_stops_the_app() -> None:
    provider = Provider()
    guarded = StreamWardenMiddleware(chat_app(provider), **EARLY)
    async with serve_in_process(guarded) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reader = Reader(client)
            await wait_for(lambda: KEEPALIVE in reader.received, what="a keep-alive")
            reader.task.cancel()  # the client goes away; the app is still waiting
            await asyncio.wait({reader.task})
            async with asyncio.timeout(10):
                await provider.unwound.wait()  # stopped, not released
        assert not provider.release.is_set()
        await wait_for(lambda: bool(guarded.streams.finished), what="the stream's record")
    assert guarded.streams.finished[-1].meter.end_state == "client_cancelled"


async def test_an_app_that_starts_in_time_and_a_request_for_no_stream_are_left_alone() -> None:
    provider = Provider()
    provider.release.set()  # answers at once
    guarded = StreamWardenMiddleware(chat_app(provider), early_headers_after="5s")
    async with serve_in_process(guarded) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            reader = Reader(client)
            async with asyncio.timeout(10):
                await reader.task
    assert reader.headers is not None and reader.headers["x-answered-by"] == "app"
    assert reader.received.startswith(b"data: ")
    assert reader.received.endswith(b"data: [DONE]\n\n")
    # A request that asks for no stream never gets an early head, however long the app takes.
    provider = Provider()
    guarded = StreamWardenMiddleware(chat_app(provider), **EARLY)
    async with serve_in_process(guarded) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            plain = asyncio.create_task(client.post(CHAT, json={"stream": False}))
            async with asyncio.timeout(10):
                await provider.waiting.wait()
            # Bounded wait for an absence, three times early_headers_after: a
            # wrongly armed timer would commit its head meanwhile, and the
            # answer below would be an event stream.
            await asyncio.wait({plain}, timeout=0.3)
            provider.release.set()
            answer = await plain
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["choices"][0]["message"]["content"] == "hello"
    assert not guarded.streams.finished


def test_the_option_is_the_middlewares_own_now(caplog: pytest.LogCaptureFixture) -> None:
    options: dict[str, Any] = {"early_headers_after": "5s"}
    with caplog.at_level("WARNING", logger="streamwarden.middleware"):
        middleware = StreamWardenMiddleware(Starlette(), **options)
    assert "sidecar-only" not in caplog.text
    assert middleware.settings.early_headers_after == 5.0
