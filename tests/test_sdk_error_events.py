"""The official SDKs end silently on a truncated stream, and raise on our error event.

A tiny local server replays bytes to the real ``openai`` and ``anthropic``
clients: first the truncated provider stream as is (the problem: the SDK
ends without a word), then the same bytes after the relay has appended its
synthesized error event (the SDK raises, carrying the code).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anthropic
import openai
import pytest
from aiohttp import web

from streamwarden.relay import Limits, Relay
from streamwarden.sse import SSEFramer

STREAMS = Path(__file__).parent / "fixtures" / "streams"
LIMITS = Limits(15.0, 60.0, 1800.0, 1 << 20)

Replay = Callable[[bytes], str]


@pytest.fixture
async def replay() -> AsyncIterator[Replay]:
    """Serve the most recently set bytes as an event stream on every POST."""
    body = {"bytes": b""}

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body["bytes"])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    def set_bytes(data: bytes) -> str:
        body["bytes"] = data
        return f"http://127.0.0.1:{port}"

    yield set_bytes
    await runner.cleanup()


def cut_before_terminal(name: str, path: str, terminal: Callable[[Relay], bool]) -> bytes:
    framer = SSEFramer()
    relay = Relay(
        LIMITS, started_at=0, now=0, path=path, content_type="text/event-stream", headers={}
    )
    kept = b""
    for frame in framer.feed((STREAMS / name).read_bytes()):
        relay.feed(frame.raw, 1.0)
        if terminal(relay):
            return kept
        kept += frame.raw
    raise AssertionError("fixture has no terminal event")


def through_relay(data: bytes, path: str) -> bytes:
    relay = Relay(
        LIMITS, started_at=0, now=0, path=path, content_type="text/event-stream", headers={}
    )
    return relay.feed(data, 1.0) + relay.upstream_eof(2.0)


def _terminal_seen(relay: Relay) -> bool:
    return relay._terminal_seen


async def openai_chat_text(base_url: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="test", max_retries=0)
    text = ""
    stream = await client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
    await client.close()
    return text


async def test_openai_chat_sdk_ends_silently_on_truncation_and_raises_on_our_error(
    replay: Replay,
) -> None:
    cut = cut_before_terminal("openai_chat_text.sse", "/v1/chat/completions", _terminal_seen)
    # The problem: the SDK returns a shorter answer without any error.
    text = await openai_chat_text(replay(cut))
    assert text  # it got the truncated answer and no exception
    # Through the relay: the same bytes plus the synthesized error event.
    with pytest.raises(openai.APIError) as caught:
        await openai_chat_text(replay(through_relay(cut, "/v1/chat/completions")))
    assert caught.value.code == "stream_truncated"
    assert "stream_truncated" in caught.value.message


async def openai_responses_text(base_url: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="test", max_retries=0)
    text = ""
    stream = await client.responses.create(model="gpt-4.1-mini", input="hi", stream=True)
    async for event in stream:
        if event.type == "response.output_text.delta":
            text += event.delta
    await client.close()
    return text


async def test_openai_responses_sdk_raises_on_our_error(replay: Replay) -> None:
    cut = cut_before_terminal("openai_responses_text.sse", "/v1/responses", _terminal_seen)
    assert await openai_responses_text(replay(cut))  # silent without us
    with pytest.raises(openai.APIError) as caught:
        await openai_responses_text(replay(through_relay(cut, "/v1/responses")))
    assert caught.value.code == "stream_truncated"


async def anthropic_text(base_url: str) -> str:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="test", max_retries=0)
    text = ""
    stream = await client.messages.create(
        model="claude-sonnet-4-20250514",
        max_tokens=100,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
    )
    async for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "text_delta":
            text += event.delta.text
    await client.close()
    return text


async def test_anthropic_sdk_ends_silently_on_truncation_and_raises_on_our_error(
    replay: Replay,
) -> None:
    cut = cut_before_terminal("anthropic_text.sse", "/v1/messages", _terminal_seen)
    assert await anthropic_text(replay(cut))
    with pytest.raises(anthropic.APIStatusError) as caught:
        await anthropic_text(replay(through_relay(cut, "/v1/messages")))
    assert caught.value.status_code == 200
    assert "stream_truncated" in str(caught.value)
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["error"]["code"] == "stream_truncated"


async def test_anthropic_sdk_ignores_an_unnamed_error_payload(replay: Replay) -> None:
    """Why the anthropic dialect names its error event: a bare data error is skipped."""
    cut = cut_before_terminal("anthropic_text.sse", "/v1/messages", _terminal_seen)
    bare = cut + b'data: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    assert await anthropic_text(replay(bare))
