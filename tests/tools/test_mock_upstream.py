"""Specification of the simulated LLM upstream (``streamwarden.tools.mock``).

Every test starts the real mock on a free loopback port and talks to it with
real clients: aiohttp, and the official ``openai`` and ``anthropic`` SDKs.
The mock is the ground truth of all integration tests, so these tests check
both sides of each claim: what the client saw, and what the mock recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anthropic
import httpx2
import openai
import pytest
from multidict import CIMultiDict

from streamwarden.core.sse import SSEDecoder
from streamwarden.tools.mock import (
    Fault,
    MockServer,
    MockSettings,
    mock_text,
    run_mock_cli,
    start_mock,
    tool_call_arguments,
)
from streamwarden.tools.probe.measure import read_stamp

# Unpaced by default so the file stays fast; pacing has its own tests.
FAST = MockSettings(tokens_per_second=0, ttft=0, tokens=12)
CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "stream": True}
MESSAGES = {
    "model": "claude-test",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
}


@pytest.fixture
async def mock() -> AsyncIterator[MockServer]:
    server = await start_mock(settings=FAST)
    yield server
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def openai_client(server: MockServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="test-key", max_retries=0, timeout=10.0
    )


def anthropic_client(server: MockServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=server.url, api_key="test-key", max_retries=0, timeout=10.0
    )


def sse_events(raw: bytes) -> list[Any]:
    decoder = SSEDecoder()
    return [*decoder.feed(raw), *decoder.close()]


def chat_contents(raw: bytes) -> list[str]:
    """The content deltas of an OpenAI chat stream, in order."""
    contents = []
    for event in sse_events(raw):
        if event.data == "[DONE]":
            continue
        for choice in json.loads(event.data)["choices"]:
            if choice["delta"].get("content"):
                contents.append(choice["delta"]["content"])
    return contents


# --- the official SDKs see a real provider ---------------------------------


async def test_openai_sdk_streams_the_whole_answer_with_usage(mock: MockServer) -> None:
    stream = await openai_client(mock).chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-mock-request-id": "sdk-chat", "x-mock-tokens": "50"},
    )
    text, usage, chunks = "", None, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == mock_text(50)
    assert usage is not None and usage.completion_tokens == 50
    record = await mock.stats.wait_ended("sdk-chat")
    assert (record.tokens_generated, record.completed, record.closed_early) == (chunks, True, False)
    assert record.dialect == "openai-chat" and record.status == 200


async def test_openai_sdk_gets_a_whole_reply_when_not_streaming(mock: MockServer) -> None:
    reply = await openai_client(mock).chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-request-id": "sdk-whole"},
    )
    assert reply.choices[0].message.content == mock_text(12)
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    record = await mock.stats.wait_ended("sdk-whole")
    assert (record.streamed, record.completed, record.tokens_generated) == (False, True, 12)


async def test_openai_sdk_streams_tool_call_argument_fragments(mock: MockServer) -> None:
    stream = await openai_client(mock).chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-mock-tool-call": "1"},
    )
    arguments, name, finish = "", None, None
    async for chunk in stream:
        choice = chunk.choices[0]
        for call in choice.delta.tool_calls or []:
            name = name or (call.function.name if call.function else None)
            arguments += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    assert name == "lookup" and finish == "tool_calls"
    assert arguments == tool_call_arguments(12)
    assert json.loads(arguments) == {"query": mock_text(12)}


async def test_openai_sdk_streams_the_responses_api(mock: MockServer) -> None:
    stream = await openai_client(mock).responses.create(model="gpt-test", input="hi", stream=True)
    deltas, sequence, completed = [], [], None
    async for event in stream:
        sequence.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            completed = event.response
    assert "".join(deltas) == mock_text(12)
    assert sequence == list(range(len(sequence)))
    assert completed is not None and completed.usage is not None
    assert completed.usage.output_tokens == 12 and completed.output_text == mock_text(12)


async def test_anthropic_sdk_streams_the_whole_answer(mock: MockServer) -> None:
    client = anthropic_client(mock)
    async with client.messages.stream(
        model="claude-test",
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-request-id": "sdk-anthropic", "x-mock-tokens": "45"},
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == mock_text(45)
    assert final.usage.output_tokens == 45 and final.stop_reason == "end_turn"
    record = await mock.stats.wait_ended("sdk-anthropic")
    assert (record.tokens_generated, record.completed) == (45, True)


async def test_anthropic_sdk_assembles_a_streamed_tool_use_block(mock: MockServer) -> None:
    async with anthropic_client(mock).messages.stream(
        model="claude-test",
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-tool-call": "1"},
    ) as stream:
        final = await stream.get_final_message()
    block = final.content[0]
    assert block.type == "tool_use" and block.name == "lookup"
    assert block.input == {"query": mock_text(12)}
    assert final.stop_reason == "tool_use"


async def test_anthropic_sdk_gets_a_whole_reply_when_not_streaming(mock: MockServer) -> None:
    message = await anthropic_client(mock).messages.create(
        model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].type == "text" and message.content[0].text == mock_text(12)
    assert message.usage.output_tokens == 12


# --- every wire format, byte for byte where it matters -----------------------


@dataclass(frozen=True)
class Decoded:
    text: str
    token_events: int
    usage: int | None
    terminal: bool


def decode_chat(raw: bytes) -> Decoded:
    contents = chat_contents(raw)
    usage = None
    for event in sse_events(raw):
        if event.data != "[DONE]" and json.loads(event.data).get("usage"):
            usage = json.loads(event.data)["usage"]["completion_tokens"]
    return Decoded("".join(contents), len(contents), usage, raw.endswith(b"data: [DONE]\n\n"))


def decode_responses(raw: bytes) -> Decoded:
    deltas, usage, terminal = [], None, False
    for event in sse_events(raw):
        payload = json.loads(event.data)
        assert payload["type"] == event.event
        if event.event == "response.output_text.delta":
            deltas.append(payload["delta"])
        if event.event == "response.completed":
            usage, terminal = payload["response"]["usage"]["output_tokens"], True
    return Decoded("".join(deltas), len(deltas), usage, terminal)


def decode_anthropic(raw: bytes) -> Decoded:
    deltas, usage, terminal = [], None, False
    for event in sse_events(raw):
        payload = json.loads(event.data)
        if event.event == "content_block_delta":
            deltas.append(payload["delta"]["text"])
        if event.event == "message_delta":
            usage = payload["usage"]["output_tokens"]
        terminal = event.event == "message_stop"
    return Decoded("".join(deltas), len(deltas), usage, terminal)


def decode_gemini(raw: bytes) -> Decoded:
    assert b"\r\n\r\n" in raw and b"\n\n" not in raw.replace(b"\r\n", b"")
    texts: list[str] = []
    usage, terminal = None, False
    for event in sse_events(raw):
        candidate = json.loads(event.data)["candidates"][0]
        texts.extend(part["text"] for part in candidate["content"]["parts"] if part["text"])
        if candidate.get("finishReason") == "STOP":
            usage = json.loads(event.data)["usageMetadata"]["candidatesTokenCount"]
            terminal = True
    return Decoded("".join(texts), len(texts), usage, terminal)


def decode_ollama(member: str) -> Callable[[bytes], Decoded]:
    def decode(raw: bytes) -> Decoded:
        lines = [json.loads(line) for line in raw.decode().splitlines()]
        pieces = [
            line["message"]["content"] if member == "message" else line["response"]
            for line in lines
            if not line["done"]
        ]
        last = lines[-1]
        return Decoded("".join(pieces), len(pieces), last.get("eval_count"), last["done"])

    return decode


def decode_data_stream(raw: bytes) -> Decoded:
    parts = [line.split(":", 1) for line in raw.decode().splitlines()]
    pieces = [json.loads(value) for code, value in parts if code == "0"]
    usage = next((json.loads(v)["usage"]["completionTokens"] for c, v in parts if c == "d"), None)
    return Decoded("".join(pieces), len(pieces), usage, parts[-1][0] == "d")


def decode_ui_stream(raw: bytes) -> Decoded:
    deltas, usage, done = [], None, False
    for event in sse_events(raw):
        if event.data == "[DONE]":
            done = True
            continue
        chunk = json.loads(event.data)
        if chunk["type"] == "text-delta":
            deltas.append(chunk["delta"])
        if chunk["type"] == "finish":
            usage = chunk["messageMetadata"]["usage"]["outputTokens"]
    return Decoded("".join(deltas), len(deltas), usage, done)


def decode_tgi(raw: bytes) -> Decoded:
    # TGI writes "data:" with no space, and its last token's event is the terminal one.
    assert raw.startswith(b'data:{"index":1,') and b"data: " not in raw
    events = [json.loads(event.data) for event in sse_events(raw)]
    assert [event["index"] for event in events] == list(range(1, len(events) + 1))
    text = "".join(event["token"]["text"] for event in events)
    last = events[-1]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert last["generated_text"] == text and last["details"]["finish_reason"] == "length"
    return Decoded(text, len(events), last["details"]["generated_tokens"], True)


def decode_generic(raw: bytes) -> Decoded:
    events = sse_events(raw)
    assert all(event.event == "tick" for event in events)
    assert [event.id for event in events] == [str(i + 1) for i in range(len(events))]
    return Decoded("".join(event.data for event in events), len(events), None, True)


@dataclass(frozen=True)
class Wire:
    name: str
    method: str
    path: str
    body: dict[str, Any] | None
    content_type: str
    decode: Callable[[bytes], Decoded]


SSE_UTF8 = "text/event-stream; charset=utf-8"
WIRES = [
    Wire(
        "openai-chat",
        "POST",
        "/v1/chat/completions",
        {**CHAT, "stream_options": {"include_usage": True}},
        SSE_UTF8,
        decode_chat,
    ),
    Wire(
        "openai-responses",
        "POST",
        "/v1/responses",
        {"model": "m", "input": "hi", "stream": True},
        SSE_UTF8,
        decode_responses,
    ),
    Wire("anthropic", "POST", "/v1/messages", MESSAGES, SSE_UTF8, decode_anthropic),
    Wire(
        "gemini",
        "POST",
        "/v1beta/models/gemini-test:streamGenerateContent?alt=sse",
        {"contents": []},
        "text/event-stream",
        decode_gemini,
    ),
    Wire(
        "ollama-chat",
        "POST",
        "/api/chat",
        {"model": "llama3.2", "messages": []},
        "application/x-ndjson",
        decode_ollama("message"),
    ),
    Wire(
        "ollama-generate",
        "POST",
        "/api/generate",
        {"model": "llama3.2", "prompt": "hi"},
        "application/x-ndjson",
        decode_ollama("response"),
    ),
    Wire(
        "vercel-data-stream",
        "POST",
        "/vercel/data-stream",
        {"messages": []},
        "text/plain; charset=utf-8",
        decode_data_stream,
    ),
    Wire(
        "vercel-ui-stream",
        "POST",
        "/vercel/ui-stream",
        {"messages": []},
        "text/event-stream",
        decode_ui_stream,
    ),
    Wire("tgi", "POST", "/generate_stream", {"inputs": "hi"}, "text/event-stream", decode_tgi),
    Wire("generic", "GET", "/sse", None, "text/event-stream", decode_generic),
]


@pytest.mark.parametrize("wire", WIRES, ids=[wire.name for wire in WIRES])
async def test_each_wire_format_streams_the_answer_and_its_terminal(
    mock: MockServer, http: aiohttp.ClientSession, wire: Wire
) -> None:
    headers = {"x-mock-request-id": f"wire-{wire.name}", "x-mock-tokens": "41"}
    url = mock.url + wire.path
    async with http.request(wire.method, url, json=wire.body, headers=headers) as response:
        raw = await response.read()
    assert response.headers["Content-Type"] == wire.content_type
    assert response.headers["x-mock-request-id"] == f"wire-{wire.name}"
    assert "Content-Length" not in response.headers
    decoded = wire.decode(raw)
    # 41 tokens cover the whole vocabulary: multi-byte text, quotes, newlines.
    assert decoded.text == mock_text(41)
    assert decoded.terminal
    assert decoded.usage == (None if wire.name == "generic" else 41)
    record = await mock.stats.wait_ended(f"wire-{wire.name}")
    assert record.wire == wire.name
    assert (record.tokens_generated, record.completed, record.closed_early) == (
        decoded.token_events,
        True,
        False,
    )


async def test_vercel_streams_carry_their_protocol_headers(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mock.url + "/vercel/data-stream", json={}) as response:
        raw = await response.read()
    assert response.headers["x-vercel-ai-data-stream"] == "v1"
    assert raw.startswith(b'f:{"messageId":"msg-') and b'\ne:{"finishReason":"stop"' in raw
    async with http.post(mock.url + "/vercel/ui-stream", json={}) as response:
        raw = await response.read()
    assert response.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert raw.startswith(b'data: {"type":"start","messageId":"msg-')
    assert raw.endswith(
        b'data: {"type":"finish-step"}\n\n' + raw[raw.rindex(b'data: {"type":"finish",') :]
    )


async def test_openai_chat_stream_is_framed_like_the_real_api(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mock.url + "/v1/chat/completions?tokens=1", json=CHAT) as response:
        raw = await response.read()
    blocks = raw.split(b"\n\n")
    assert (
        blocks[0].startswith(b'data: {"id":"chatcmpl-')
        and b'"object":"chat.completion.chunk"' in blocks[0]
    )
    assert b'"delta":{"role":"assistant","content":"","refusal":null}' in blocks[0]
    assert b'"delta":{"content":"Streams"},"logprobs":null,"finish_reason":null}]}' in blocks[1]
    assert b'"delta":{},"logprobs":null,"finish_reason":"stop"}]}' in blocks[2]
    assert blocks[3:] == [b"data: [DONE]", b""]


async def test_gemini_requires_alt_sse_like_the_mock_documents(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mock.url + "/v1beta/models/g:streamGenerateContent", json={}) as response:
        body = await response.json()
    assert response.status == 400 and body["error"]["status"] == "INVALID_ARGUMENT"


async def test_tokens_are_paced_by_ttft_and_tokens_per_second(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    # The mock's own account of when each token left (``stamp=1``: its clock
    # as the block went to the socket, after the pacing wait), against the
    # schedule counted from before the request: token k is due ttft + k/tps
    # after the start, and none may leave before it is due. A late token (a
    # busy machine) is no failure; an early one is.
    requested = time.time()
    async with http.get(mock.url + "/sse?tokens=9&tps=40&ttft=0.15&stamp=1") as response:
        raw = await response.read()
    sent = [read_stamp(block) or 0.0 for block in raw.split(b"\n\n") if block]
    assert len(sent) == 9 and len(sse_events(raw)) == 9
    due = [requested + 0.15 + k / 40 for k in range(9)]
    # 1 ms of slack: two readings of the clock, one printed to the microsecond.
    early = [(k, due[k] - at) for k, at in enumerate(sent) if at < due[k] - 0.001]
    assert not early, early


# --- controls -----------------------------------------------------------------


async def test_query_parameters_win_over_headers(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?tokens=5"
    async with http.post(url, json=CHAT, headers={"x-mock-tokens": "3"}) as response:
        assert len(chat_contents(await response.read())) == 5


async def test_bad_controls_are_refused_with_one_clear_message(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    cases = [
        ("/v1/chat/completions?tps=fast", CHAT, "bad tps 'fast'"),
        ("/v1/chat/completions?fault=explode", CHAT, "unknown fault 'explode'"),
        (
            "/v1/chat/completions?fault=truncate",
            {**CHAT, "stream": False},
            "needs a streamed answer",
        ),
        ("/api/chat?fault=keepalive-pings", {}, "needs a server-sent events stream"),
        (
            "/api/chat?tool-call=1",
            {},
            "tool-call is supported",
        ),
    ]
    for path, body, message in cases:
        async with http.post(mock.url + path, json=body) as response:
            assert response.status == 400, path
            assert message in await response.text(), path
    assert mock.stats.records == ()


async def test_unknown_paths_answer_in_the_configured_dialect(http: aiohttp.ClientSession) -> None:
    settings = MockSettings(dialect="anthropic", tokens_per_second=0, ttft=0, tokens=4)
    async with await start_mock(settings=settings) as server:
        async with http.post(server.url + "/my/gateway/route", json={}) as response:
            decoded = decode_anthropic(await response.read())
        assert decoded.text == mock_text(4) and decoded.terminal
    with pytest.raises(ValueError, match="unknown dialect"):
        MockSettings(dialect="klingon")


# --- faults ---------------------------------------------------------------------


async def test_truncate_ends_cleanly_before_usage_and_done(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    body = {**CHAT, "stream_options": {"include_usage": True}}
    url = mock.url + "/v1/chat/completions?fault=truncate&request-id=cut"
    async with http.post(url, json=body) as response:
        raw = await response.read()  # no exception: the chunked terminator came
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw and b'"usage":{' not in raw
    assert len(chat_contents(raw)) == 6  # half of 12
    record = await mock.stats.wait_ended("cut")
    assert (record.tokens_generated, record.completed, record.closed_early) == (6, False, False)

    # After every token, truncate still withholds usage and the terminal event.
    url = mock.url + "/v1/chat/completions?fault=truncate&fault-after=99"
    async with http.post(url, json=body) as response:
        raw = await response.read()
    assert len(chat_contents(raw)) == 12 and b'"finish_reason":"stop"' in raw
    assert b"[DONE]" not in raw and b'"usage":{' not in raw


async def test_truncated_stream_ends_silently_in_the_official_sdks(mock: MockServer) -> None:
    # The problem streamwarden exists for: without a terminal event, SDKs don't notice.
    stream = await openai_client(mock).chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-mock-fault": "truncate"},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == mock_text(6)
    async with anthropic_client(mock).messages.stream(
        model="claude-test",
        max_tokens=64,
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"x-mock-fault": "truncate"},
    ) as message_stream:
        assert "".join([piece async for piece in message_stream.text_stream]) == mock_text(6)


async def test_truncate_mid_ends_cleanly_inside_an_event(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/messages?fault=truncate-mid&fault-after=4&request-id=mid"
    async with http.post(url, json=MESSAGES) as response:
        raw = await response.read()
    assert not raw.endswith(b"\n\n")
    assert raw.rsplit(b"\n\n", 1)[1].startswith(b"event: content_block_delta\ndata: {")
    assert decode_anthropic(raw).token_events == 4  # the partial event is not dispatched
    record = await mock.stats.wait_ended("mid")
    assert (record.tokens_generated, record.completed) == (4, False)


async def test_stall_keeps_the_connection_open_until_the_client_leaves(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/sse?fault=stall&fault-after=3&request-id=stall"
    response = await http.get(url)
    decoder, events = SSEDecoder(), list[Any]()
    while len(events) < 3:
        events.extend(decoder.feed(await response.content.readany()))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(response.content.readany(), 0.3)
    record = mock.stats.get("stall")
    assert record is not None and not record.ended and not record.closed_early

    # Silent for ever: only the client leaving can end it, so its end is the notice.
    response.close()
    record = await mock.stats.wait_ended("stall")
    assert record.closed_early and record.closed_at is not None
    assert (record.tokens_generated, record.completed) == (3, False)


async def test_stall_with_a_delay_resumes_the_stream(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?fault=stall&delay=0.25&request-id=resumed"
    async with http.post(url, json=CHAT) as response:
        raw = await response.read()
    assert "".join(chat_contents(raw)) == mock_text(12) and raw.endswith(b"data: [DONE]\n\n")
    # The mock's own account: the stall held it the delay at least (a lower
    # bound, which no load can break), and the stream then ran to its end.
    record = await mock.stats.wait_ended("resumed")
    assert record.completed and not record.closed_early
    assert record.ended_at is not None and record.ended_at - record.started_at >= 0.25


async def test_reset_aborts_the_connection_mid_stream(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?fault=reset&request-id=rst"
    received = b""
    with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        async with http.post(url, json=CHAT) as response:
            async for chunk in response.content.iter_any():
                received += chunk
    assert len(chat_contents(received)) == 6
    record = await mock.stats.wait_ended("rst")
    assert (record.tokens_generated, record.completed, record.closed_early) == (6, False, False)

    # The SDKs surface it as a connection error, not as a short answer.
    stream = await openai_client(mock).chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers={"x-mock-fault": "reset"},
    )
    with pytest.raises(openai.APIConnectionError):
        async for _ in stream:
            pass
    # anthropic raises: its documented base (APIError, of which 2.17 on wrap
    # the transport's error in APIConnectionError) or, before that, the raw
    # transport error it leaked. Which one is the SDK's business; that it
    # raises rather than return a short answer is what a user sees.
    with pytest.raises((anthropic.APIError, httpx2.TransportError)):
        async with anthropic_client(mock).messages.stream(
            model="claude-test",
            max_tokens=64,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-mock-fault": "reset"},
        ) as anthropic_stream:
            async for _ in anthropic_stream:
                pass


async def test_broken_chunked_encoding_is_a_client_side_protocol_error(mock: MockServer) -> None:
    # On the wire: a malformed chunk-size line right after a complete chunk, then EOF.
    reader, writer = await asyncio.open_connection("127.0.0.1", mock.port)
    request_body = json.dumps(MESSAGES).encode()
    writer.write(
        b"POST /v1/messages?fault=broken-chunked&request-id=broken HTTP/1.1\r\n"
        b"Host: mock\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(request_body)}\r\n\r\n".encode()
        + request_body
    )
    raw = await asyncio.wait_for(reader.read(), 5)  # EOF arrives: the mock closed
    writer.close()
    assert b"Transfer-Encoding: chunked" in raw
    assert raw.endswith(b"\n\n\r\nzz; this is not a chunk size\r\n")
    record = await mock.stats.wait_ended("broken")
    assert (record.tokens_generated, record.completed) == (6, False)

    # An HTTP client reports it as a protocol error. (aiohttp's C parser, as of
    # 3.14, hangs on it until its timeout instead; httpx2 fails at once.)
    async with httpx2.AsyncClient(timeout=5.0) as client:
        with pytest.raises(httpx2.RemoteProtocolError):
            async with client.stream(
                "POST", mock.url + "/v1/messages?fault=broken-chunked", json=MESSAGES
            ) as response:
                async for _ in response.aiter_bytes():
                    pass


async def test_giant_event_is_one_unbroken_event_of_the_requested_size(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?fault=giant-event&request-id=giant"
    async with http.post(url, json=CHAT) as response:
        raw = await response.read()
    blocks = raw.split(b"\n\n")
    giant = [block for block in blocks if len(block) > 1_000_000]
    assert len(giant) == 1 and len(giant[0]) + 2 == 10 * 1024 * 1024
    assert b"\n" not in giant[0] and b"\r" not in giant[0]
    assert blocks.index(giant[0]) == 7  # role chunk + 6 tokens, then the giant one
    assert raw.endswith(b"data: [DONE]\n\n")
    record = await mock.stats.wait_ended("giant")
    assert (record.tokens_generated, record.completed) == (12, True)

    async with http.post(mock.url + "/api/chat?fault=giant-event&size=5000", json={}) as response:
        lines = (await response.read()).split(b"\n")
    assert sorted(len(line) + 1 for line in lines)[-1] == 5000


async def test_garbage_is_invalid_utf8_with_no_event_structure(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?fault=garbage&request-id=junk"
    async with http.post(url, json=CHAT) as response:
        raw = await response.read()
    assert len(raw) > 100 and b"\n" not in raw and b"\r" not in raw
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    assert sse_events(raw) == []
    record = await mock.stats.wait_ended("junk")
    assert (record.tokens_generated, record.completed) == (0, False)


async def test_error_status_answers_like_the_provider(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        await openai_client(mock).chat.completions.create(
            model="gpt-test",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"x-mock-fault": "error-status"},
        )
    assert caught.value.status_code == 500 and "simulated 500 error" in caught.value.message

    # A status alone implies the fault; 529 is Anthropic's "overloaded".
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        await anthropic_client(mock).messages.create(
            model="claude-test",
            max_tokens=64,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-mock-status": "529"},
        )
    assert overloaded.value.status_code == 529

    url = mock.url + "/api/chat?fault=error-status&status=503&body=0&request-id=empty"
    async with http.post(url, json={}) as response:
        assert (response.status, await response.read()) == (503, b"")
    record = await mock.stats.wait_ended("empty")
    assert (record.status, record.completed, record.fault) == (503, False, "error-status")


async def test_slow_headers_delays_the_response_then_streams(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?fault=slow-headers&delay=0.3&request-id=slow"
    async with http.post(url, json=CHAT) as response:
        headers_at = time.monotonic()
        raw = await response.read()
    assert "".join(chat_contents(raw)) == mock_text(12)
    # The headers came no sooner than the delay after the mock took the
    # request (its own record, this process's clock): a lower bound.
    record = await mock.stats.wait_ended("slow")
    assert headers_at - record.started_at >= 0.3


async def test_client_giving_up_before_headers_is_recorded(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/messages?fault=stall-before-headers&request-id=noheaders"
    with pytest.raises(TimeoutError):
        async with http.post(url, json=MESSAGES, timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    # The headers were due in 30 s: the record ends now only because the
    # mock noticed the client leave in its silence.
    record = await mock.stats.wait_ended("noheaders")
    assert record.closed_early and record.status is None and record.closed_at is not None


async def test_keepalive_pings_sit_between_events_only(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/messages?fault=keepalive-pings&tokens=4&tps=40&ttft=0.05"
    async with http.post(url, json=MESSAGES) as response:
        raw = await response.read()
    blocks = raw.split(b"\n\n")
    assert blocks.count(b": ping") == 4  # one in the wait before each token
    assert all(block.startswith((b"event: ", b": ping")) for block in blocks[:-1])
    assert decode_anthropic(raw).text == mock_text(4)


async def test_every_fault_has_a_documented_name() -> None:
    assert sorted(fault.value for fault in Fault) == sorted(
        [
            "truncate",
            "truncate-mid",
            "stall",
            "stall-before-headers",
            "slow-headers",
            "reset",
            "broken-chunked",
            "giant-event",
            "garbage",
            "error-status",
            "keepalive-pings",
            "broken-tool-call",
        ]
    )


# --- accounting -----------------------------------------------------------------


async def test_client_leaving_mid_stream_is_noticed_at_once(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    url = mock.url + "/v1/chat/completions?tokens=400&tps=50&request-id=gone"
    response = await http.post(url, json=CHAT)
    received = b""
    while len(chat_contents(received)) < 5:
        received += await response.content.readany()
    record = mock.stats.get("gone")
    assert record is not None
    generated_when_left = record.tokens_generated  # the mock's own count, not the client's
    response.close()
    record = await mock.stats.wait_ended("gone")
    assert record.closed_early and not record.completed
    # Noticed at once: the next token or two at most (one may be in its write
    # as the close lands), not the rest of the 400.
    assert 5 <= record.tokens_generated <= generated_when_left + 2
    assert record.closed_at is not None
    assert record.started_at <= record.closed_at <= (record.ended_at or 0)


async def test_stats_are_served_as_json_and_can_be_reset(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(mock.url + "/sse?tokens=2&request-id=s1") as response:
        await response.read()
    await mock.stats.wait_ended("s1")
    async with http.get(mock.url + "/_mock/stats") as response:
        records = (await response.json())["records"]
    assert [r["request_id"] for r in records] == ["s1"]
    assert set(records[0]) >= {
        "request_id", "path", "dialect", "fault", "tokens_generated", "completed",
        "closed_early", "closed_at", "started_at", "ended_at",
    }  # fmt: skip
    assert records[0]["tokens_generated"] == 2 and records[0]["completed"] is True
    async with http.post(mock.url + "/_mock/reset") as response:
        assert response.status == 200
    assert mock.stats.records == ()


async def test_closing_the_mock_ends_stalled_streams_promptly(http: aiohttp.ClientSession) -> None:
    server = await start_mock(settings=FAST)
    response = await http.get(server.url + "/sse?fault=stall&request-id=held")
    await response.content.readany()
    async with asyncio.timeout(10):  # a hang bound only
        await server.close()
    # Ended by the mock's own shutdown step, which cancels what is in flight:
    # not a client gone (which is how aiohttp's cancel after its 1 s shutdown
    # timeout would look).
    record = server.stats.get("held")
    assert record is not None and record.ended and not record.closed_early
    response.close()


# --- echo and WebSocket ---------------------------------------------------------


async def test_echo_streams_and_hashes_a_body_larger_than_memory_limits(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    piece = os.urandom(1024 * 1024)
    expected = hashlib.sha256()
    for _ in range(70):
        expected.update(piece)

    async def upload() -> AsyncIterator[bytes]:
        for _ in range(70):  # 70 MiB: above the mock's 64 MiB whole-body limit
            yield piece

    headers = CIMultiDict([("X-Dup", "one"), ("X-Dup", "two"), ("X-Case", "KeEp")])
    url = mock.url + "/echo/a%2Fb/c?x=1&x=2&empty=&sp=%20"
    async with http.put(url, data=upload(), headers=headers) as response:
        echoed = await response.json()
    assert echoed["method"] == "PUT"
    assert echoed["path"] == "/echo/a%2Fb/c" and echoed["query_string"] == "x=1&x=2&empty=&sp=%20"
    assert echoed["body_bytes"] == 70 * 1024 * 1024
    assert echoed["body_sha256"] == expected.hexdigest()
    assert [h for h in echoed["headers"] if h[0].lower() == "x-dup"] == [
        ["X-Dup", "one"],
        ["X-Dup", "two"],
    ]
    assert ["X-Case", "KeEp"] in echoed["headers"]


async def test_websocket_echoes_and_closes_with_the_requested_code(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.ws_connect(mock.url + "/ws", headers={"x-mock-request-id": "ws"}) as ws:
        await ws.send_str("héllo 😀")
        assert await ws.receive_str() == "héllo 😀"
        await ws.send_bytes(b"\x00\xff")
        assert await ws.receive_bytes() == b"\x00\xff"
        await ws.send_str("close:4001")
        message = await ws.receive()
        assert message.type is aiohttp.WSMsgType.CLOSE and message.data == 4001
    record = await mock.stats.wait_ended("ws")
    assert (record.close_code, record.completed, record.closed_early) == (4001, True, False)


# --- command line ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--tokens-per-second", "fast"],
        ["--listen", "localhost"],
        ["--fault", "explode"],
        ["--dialect", "klingon"],
        ["--tokens", "-1"],
        ["--no-such-flag"],
    ],
)
def test_cli_rejects_a_bad_flag_with_exit_2_and_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_mock_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("streamwarden mock-upstream: error: ")


def test_cli_serves_until_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "streamwarden.tools.mock", "--listen", "127.0.0.1:0",
         "--tokens", "3", "--tokens-per-second", "0", "--dialect", "ollama-chat"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        url = line.split("listening on ", 1)[1].split()[0]
        request = urllib.request.Request(url + "/any/path", data=b"{}")
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read().decode()
        assert decode_ollama("message")(body.strip().encode()).text == mock_text(3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_mock_help_documents_every_fault_and_the_per_request_controls() -> None:
    import subprocess
    import sys

    from streamwarden.tools.mock.faults import Fault

    helped = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "mock-upstream", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert helped.returncode == 0
    for fault in Fault:
        assert f"\n  {fault.value} " in helped.stdout, fault
    for control in ("tokens", "tps", "ttft", "fault-after", "delay", "status", "request-id"):
        assert f"\n  {control} " in helped.stdout, control
    assert "x-mock-<name>" in helped.stdout and "--no-abort" in helped.stdout


async def test_tgi_answers_whole_on_generate_and_with_its_error_shape(
    mock: MockServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(mock.url + "/generate?tokens=3", json={"inputs": "hi"}) as response:
        body = await response.json()
    assert body["generated_text"] == mock_text(3) and body["details"]["generated_tokens"] == 3
    headers = {"x-mock-fault": "error-status", "x-mock-status": "429"}
    async with http.post(mock.url + "/generate_stream", json={}, headers=headers) as response:
        body = await response.json()
    assert response.status == 429 and body["error_type"] == "overloaded"
