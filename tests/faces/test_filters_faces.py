"""Output filters through both faces, read by the official SDKs.

A small aiohttp upstream serves a fixed stream whose text carries a key
split across three events, one write per event. Without streamwarden (or on
a route without filters) the SDK reads the key; through the sidecar, and
through the middleware in a Starlette app under uvicorn, it reads
``[redacted]`` in its place with every other byte unchanged, or raises on
``content_blocked`` while the upstream is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from filter_streams import (
    ASK,
    SECRET,
    TEXT,
    events_of,
    openai_chat,
    raw,
    redacted_pieces,
    responses_answer,
    split_secret,
)
from filter_streams import anthropic as anthropic_stream
from filter_streams import responses as responses_stream
from middleware_apps import serve_in_process
from sidecars import StartSidecar
from streamwarden.core.meter import EndState
from streamwarden.middleware import StreamWardenMiddleware
from upstreams import ServeUpstream
from waiting import wait_for

PIECES = split_secret(TEXT, SECRET, 3)
CHAT = openai_chat(PIECES)
MESSAGES = anthropic_stream(PIECES)
RESPONSES = responses_stream(PIECES)
REDACT = [{"builtin": "secrets", "action": "redact"}]
BLOCK = [{"builtin": "secrets", "action": "block"}]


class FixedUpstream:
    """Serves CHAT and MESSAGES one event per write; ``x-tail`` keeps a stream going.

    With ``x-tail: N`` the stream goes on (N more content events, paced) before its
    end, so a proxy that ends the stream early has to close the connection: the
    upstream records that its writes failed.
    """

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/messages", self.messages)
        self.app.router.add_post("/v1/responses", self.responses)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT, "openai-chat")

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, MESSAGES, "anthropic")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, RESPONSES, "openai-responses")

    async def _serve(self, request: web.Request, stream: bytes, dialect: str) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = events_of(stream, dialect)
        tail = int(request.headers.get("x-tail", "0"))
        try:
            for event in events[:-1]:
                await response.write(event.encode())
            for _ in range(tail):
                await asyncio.sleep(0.02)  # the upstream's pace, not a wait for the test
                await response.write(openai_chat(["."])[: -len(b"data: [DONE]\n\n")])
            await response.write(events[-1].encode())
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            self.closed.set()
        except asyncio.CancelledError:  # aiohttp cancels the handler when its client leaves
            self.closed.set()
            raise
        return response


@pytest.fixture
async def upstream(serve_upstream: ServeUpstream) -> tuple[FixedUpstream, str]:
    fixed = FixedUpstream()
    return fixed, await serve_upstream(fixed.app, handler_cancellation=True)


async def chat_text(base: str, headers: dict[str, str] | None = None) -> str:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", default_headers=headers)
    async with client:
        stream = await client.chat.completions.create(**ASK, stream=True)
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        return text


async def messages_text(base: str) -> str:
    client = anthropic.AsyncAnthropic(base_url=base, api_key="k")
    async with client:
        stream = await client.messages.create(**ASK, max_tokens=64, stream=True)
        text = ""
        async for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        return text


EXPECTED_TEXT = "".join(redacted_pieces(PIECES, SECRET))


# -- the sidecar ----------------------------------------------------------------------


async def test_the_sdks_read_the_key_without_filters_and_redacted_through_the_sidecar(
    upstream: tuple[FixedUpstream, str], start_sidecar: StartSidecar
) -> None:
    _, url = upstream
    # The problem: split over three events, the key reaches the reader whole.
    assert SECRET in await chat_text(url)
    assert SECRET in await messages_text(url)
    plain = await start_sidecar(url)
    assert SECRET in await chat_text(plain.proxy_url)
    # Through a sidecar with the secrets set: [redacted], every other byte the upstream's.
    sidecar = await start_sidecar(url, output_filters=REDACT)
    assert await chat_text(sidecar.proxy_url) == EXPECTED_TEXT
    assert await messages_text(sidecar.proxy_url) == EXPECTED_TEXT
    assert await raw(sidecar.proxy_url) == openai_chat(redacted_pieces(PIECES, SECRET))
    await wait_for(lambda: len(sidecar.tracker.finished) == 3)
    assert {s.meter.end_state for s in sidecar.tracker.finished} == {EndState.COMPLETED}
    metrics = sidecar.metrics.render().decode()
    assert 'streamwarden_filter_matches_total{action="redact",filter="secrets"} 3.0' in metrics
    assert "streamwarden_filter_holdback_seconds_count" in metrics


async def test_the_responses_sdk_reads_the_redacted_text_in_the_final_response_too(
    upstream: tuple[FixedUpstream, str], start_sidecar: StartSidecar
) -> None:
    _, url = upstream
    # The API repeats the whole text in its summary events and in the final response.
    assert await responses_answer(url) == ("".join(PIECES),) * 3
    sidecar = await start_sidecar(url, output_filters=REDACT)
    assert await responses_answer(sidecar.proxy_url) == (EXPECTED_TEXT,) * 3
    body = await raw(sidecar.proxy_url, "/v1/responses")
    assert body == responses_stream(redacted_pieces(PIECES, SECRET))
    assert SECRET[8:14].encode() not in body and SECRET[-6:].encode() not in body
    await wait_for(lambda: len(sidecar.tracker.finished) == 3)
    assert {s.meter.end_state for s in sidecar.tracker.finished} == {EndState.COMPLETED}
    # One match per stream, not one per repetition.
    metrics = sidecar.metrics.render().decode()
    assert 'streamwarden_filter_matches_total{action="redact",filter="secrets"} 3.0' in metrics


async def test_a_block_raises_in_the_sdks_closes_the_upstream_and_ends_blocked(
    upstream: tuple[FixedUpstream, str], start_sidecar: StartSidecar
) -> None:
    fixed, url = upstream
    sidecar = await start_sidecar(url, output_filters=BLOCK)
    with pytest.raises(openai.APIError) as caught:
        await chat_text(sidecar.proxy_url, {"x-tail": "500"})
    assert caught.value.code == "content_blocked"
    assert SECRET[:12] not in str(caught.value)
    # The upstream was still sending: the sidecar closed it.
    async with asyncio.timeout(10):
        await fixed.closed.wait()
    with pytest.raises(anthropic.APIStatusError) as refused:
        await messages_text(sidecar.proxy_url)
    assert "content_blocked" in str(refused.value)
    await wait_for(lambda: len(sidecar.tracker.finished) == 2)
    assert {s.meter.end_state for s in sidecar.tracker.finished} == {EndState.BLOCKED}
    metrics = sidecar.metrics.render().decode()
    assert 'streamwarden_filter_matches_total{action="block",filter="secrets"} 2.0' in metrics
    assert 'streamwarden_synthesized_errors_total{code="content_blocked"} 2.0' in metrics
    assert 'end_state="blocked"' in metrics


async def test_a_route_without_filters_is_left_alone(
    upstream: tuple[FixedUpstream, str], start_sidecar: StartSidecar
) -> None:
    _, url = upstream
    sidecar = await start_sidecar(
        url, output_filters=BLOCK, routes={"/v1/chat": {"output_filters": []}}
    )
    assert await raw(sidecar.proxy_url) == CHAT
    with pytest.raises(anthropic.APIStatusError, match="content_blocked"):
        await messages_text(sidecar.proxy_url)  # the other routes still block


# -- the middleware -------------------------------------------------------------------


def app_serving() -> Starlette:
    """An app that relays a provider's stream (CHAT, MESSAGES) one event per send."""

    def serving(stream: bytes, dialect: str) -> Any:
        async def endpoint(request: Request) -> StreamingResponse:
            async def body() -> AsyncIterator[bytes]:
                for event in events_of(stream, dialect):
                    yield event.encode()
                    await asyncio.sleep(0)  # one event per send, as a provider's SDK loop does

            return StreamingResponse(body(), media_type="text/event-stream")

        return endpoint

    return Starlette(
        routes=[
            Route("/v1/chat/completions", serving(CHAT, "openai-chat"), methods=["POST"]),
            Route("/v1/messages", serving(MESSAGES, "anthropic"), methods=["POST"]),
        ]
    )


@contextlib.asynccontextmanager
async def middleware(**options: Any) -> AsyncIterator[tuple[str, StreamWardenMiddleware]]:
    guarded = StreamWardenMiddleware(app_serving(), **options)
    async with serve_in_process(guarded) as base:
        yield base, guarded


async def test_the_middleware_redacts_and_blocks_for_the_sdks() -> None:
    async with serve_in_process(app_serving()) as base:
        assert SECRET in await chat_text(base)  # the app alone hands the key out
        assert SECRET in await messages_text(base)
    async with middleware(output_filters=REDACT) as (base, guarded):
        assert await chat_text(base) == EXPECTED_TEXT
        assert await messages_text(base) == EXPECTED_TEXT
        assert await raw(base) == openai_chat(redacted_pieces(PIECES, SECRET))
        assert await raw(base, "/v1/messages") == anthropic_stream(redacted_pieces(PIECES, SECRET))
    async with middleware(output_filters=BLOCK) as (base, guarded):
        with pytest.raises(openai.APIError) as caught:
            await chat_text(base)
        assert caught.value.code == "content_blocked"
        with pytest.raises(anthropic.APIStatusError, match="content_blocked"):
            await messages_text(base)
        await wait_for(lambda: len(guarded.streams.finished) == 2)
        assert {s.meter.end_state for s in guarded.streams.finished} == {EndState.BLOCKED}
        assert 'end_state="blocked"' in guarded.metrics.render().decode()
