"""What guards an HTTP stream guards a Responses WebSocket's: filters, the stream limit, spans.

Each ``response.create`` over the Responses API's WebSocket is a stream
through the sidecar's pipeline (tests/sidecar/test_responses_websocket.py);
here, what a route sets for its streams holds for these too:

- ``output_filters``: a key split across delta messages reaches the openai
  SDK whole directly (no message holds it, every per-message check misses
  it); through the sidecar it reads ``[redacted]``, message for message what
  the same answer over SSE becomes, and a ``block`` ends the session with a
  ``content_blocked`` error message and a 1011 close;
- ``max_concurrent_streams``: each response holds a place as an HTTP stream
  does; past the limit its ``response.create`` goes nowhere and the client
  gets an ``error`` message ``too_many_streams``, which the SDK yields as an
  event (it does not raise on one), and the session goes on;
- telemetry: each response is a server span of its own.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web
from websockets.exceptions import ConnectionClosedError

from filter_streams import SECRET, TEXT, raw, redacted_pieces, responses_answer, split_secret
from filter_streams import responses as responses_stream
from sidecars import StartSidecar
from streamwarden.core.messages import MessageSession, refusal_message
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import SSEDecoder
from streamwarden.tools.mock import MockServer, mock_text
from upstreams import ServeUpstream
from waiting import wait_for

PIECES = split_secret(TEXT, SECRET, 3)
#: The answer's events' data: over the WebSocket, each is one message.
MESSAGES = [event.data for event in SSEDecoder().feed(responses_stream(PIECES))]
EXPECTED_TEXT = "".join(redacted_pieces(PIECES, SECRET))
REDACT = [{"builtin": "secrets", "action": "redact"}]
BLOCK = [{"builtin": "secrets", "action": "block"}]


class FixedResponses:
    """One answer with a key split across three deltas, over SSE and over a WebSocket."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/responses", self.sse)
        self.app.router.add_get("/v1/responses", self.websocket)
        #: Set when a WebSocket session ended (its client, the sidecar, closed it).
        self.closed = asyncio.Event()

    async def sse(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for data in MESSAGES[: int(request.query.get("cut", len(MESSAGES)))]:
            kind = json.loads(data)["type"]
            await response.write(f"event: {kind}\ndata: {data}\n\n".encode())
        await response.write_eof()
        return response

    async def websocket(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        try:
            async for message in ws:
                kind = message.type
                if kind is aiohttp.WSMsgType.TEXT and '"response.create"' in message.data:
                    cut = int(request.query.get("cut", len(MESSAGES)))
                    for data in MESSAGES[:cut]:
                        await ws.send_str(data)
                    if cut < len(MESSAGES):  # ends cleanly half-way: 1000, no terminal event
                        await ws.close()
        finally:
            self.closed.set()
        return ws


@pytest.fixture
async def fixed(serve_upstream: ServeUpstream) -> tuple[FixedResponses, str]:
    upstream = FixedResponses()
    return upstream, await serve_upstream(upstream.app)


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=0)


async def ws_answer(url: str) -> tuple[str, str, str]:
    """The answer as the SDK's ``responses.connect()`` gives it: the deltas, the text's
    ``done`` event, and the final response's ``output_text``."""
    deltas = done = final = ""
    async with client(url).responses.connect() as connection:
        await connection.response.create(model="m", input="key?")
        async for event in connection:
            if event.type == "response.output_text.delta":
                deltas += event.delta
            elif event.type == "response.output_text.done":
                done = event.text
            elif event.type == "response.completed":
                final = event.response.output_text
                break
    return deltas, done, final


async def ws_messages(url: str, query: str = "") -> tuple[list[str], int | None]:
    """The messages of one answer, as they came over the WebSocket, and its close code
    (``None``: it completed, and the client closed)."""
    out: list[str] = []
    address = url.replace("http", "ws") + "/v1/responses" + query
    async with aiohttp.ClientSession() as session, session.ws_connect(address) as ws:
        await ws.send_str(json.dumps({"type": "response.create", "model": "m"}))
        async for message in ws:
            out.append(message.data)
            if json.loads(message.data)["type"] == "response.completed":
                return out, None
        return out, ws.close_code


async def test_a_key_split_across_messages_reads_redacted_through_the_sidecar_as_over_sse(
    fixed: tuple[FixedResponses, str], start_sidecar: StartSidecar
) -> None:
    _, url = fixed
    # Directly: no delta message holds the key, and the SDK reads it whole from them.
    assert all(SECRET not in m for m in MESSAGES if "output_text.delta" in m)
    assert await ws_answer(url) == (TEXT,) * 3

    sidecar = await start_sidecar(url, output_filters=REDACT)
    assert await ws_answer(sidecar.proxy_url) == (EXPECTED_TEXT,) * 3
    assert await responses_answer(sidecar.proxy_url) == (EXPECTED_TEXT,) * 3
    # Message for message what the same answer's events are over SSE, redacted.
    sse = [event.data for event in SSEDecoder().feed(await raw(sidecar.proxy_url, "/v1/responses"))]
    messages, _ = await ws_messages(sidecar.proxy_url)
    assert messages == sse and len(messages) == len(MESSAGES)
    assert not any(SECRET[8:14] in m or SECRET[-6:] in m for m in messages)
    await wait_for(lambda: len(sidecar.tracker.finished) == 5, what="five streams")
    assert {r.meter.end_state for r in sidecar.tracker.finished} == {EndState.COMPLETED}
    metrics = sidecar.metrics.render().decode()
    assert 'streamwarden_filter_matches_total{action="redact",filter="secrets"} 5.0' in metrics


async def test_an_answer_cut_while_messages_are_held_gets_them_then_its_error_as_over_sse(
    fixed: tuple[FixedResponses, str], start_sidecar: StartSidecar
) -> None:
    _, url = fixed
    # Cut after the fifth delta: the filters hold the four that may begin a key,
    # and at the cut the key, all but its last character, is decided on as it stands.
    cut = "?cut=8"
    messages, code = await ws_messages(url, cut)
    assert messages == MESSAGES[:8] and code == 1000  # directly: a normal close, silent
    sidecar = await start_sidecar(url, output_filters=REDACT)
    messages, code = await ws_messages(sidecar.proxy_url, cut)
    sse = await raw(sidecar.proxy_url, "/v1/responses" + cut)
    assert messages == [event.data for event in SSEDecoder().feed(sse)]
    assert code == 1011 and json.loads(messages[-1])["code"] == "stream_truncated"
    # What was held went out before the error, redacted, as over SSE.
    deltas = [json.loads(m)["delta"] for m in messages if "output_text.delta" in m]
    assert deltas == redacted_pieces(PIECES, SECRET)[:5]


async def test_a_block_ends_the_session_with_content_blocked_and_a_1011_close(
    fixed: tuple[FixedResponses, str], start_sidecar: StartSidecar
) -> None:
    upstream, url = fixed
    sidecar = await start_sidecar(url, output_filters=BLOCK)
    events: list[Any] = []
    with pytest.raises(ConnectionClosedError) as raised:
        async with asyncio.timeout(30), client(sidecar.proxy_url).responses.connect() as connection:
            await connection.response.create(model="m", input="key?")
            async for event in connection:
                events.append(event)
    assert raised.value.rcvd is not None and raised.value.rcvd.code == 1011
    error = events[-1]
    assert error.type == "error" and error.error.code == "content_blocked", error
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == TEXT[: TEXT.index(SECRET)][: len(text)]  # nothing of the key went out
    assert not any(SECRET[:4] in str(e) for e in events)
    async with asyncio.timeout(10):
        await upstream.closed.wait()  # the sidecar closed the upstream session
    await wait_for(lambda: len(sidecar.tracker.finished) == 1, what="the stream recorded")
    assert sidecar.tracker.finished[0].meter.end_state == EndState.BLOCKED


TOKENS = 8
FAST = {"tokens": str(TOKENS), "tps": "0", "ttft": "0"}


async def test_past_max_concurrent_streams_a_response_is_refused_and_the_session_goes_on(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, max_concurrent_streams="1")
    holding = {**FAST, "fault": "stall", "request-id": "holding"}
    async with client(sidecar.proxy_url).responses.connect(extra_query=holding) as first:
        await first.response.create(model="gpt-4.1", input="hi")
        async for event in first:
            if event.type == "response.output_text.delta":
                break  # mid-answer (the mock stalls): its stream holds the one place
        # An HTTP stream finds the place taken by the WebSocket's response.
        async with httpx.AsyncClient(timeout=10) as http:
            body = {"model": "m", "stream": True, "messages": []}
            refused = await http.post(sidecar.proxy_url + "/v1/chat/completions", json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_streams"

        queued = {**FAST, "request-id": "second"}
        async with client(sidecar.proxy_url).responses.connect(extra_query=queued) as second:
            await second.response.create(model="gpt-4.1", input="hi")
            # The SDK yields the refusal as an event; it does not raise, and the session stays.
            event = await second.recv()
            assert event.type == "error" and event.error.code == "too_many_streams", event
            assert "1 streams are open" in event.error.message
            record = mock.stats.get("second")
            assert record is not None and record.tokens_planned == 0  # it went nowhere
            await first.close()  # the first client leaves: its place goes back
            await wait_for(lambda: len(sidecar.tracker.finished) == 1, what="the first recorded")
            await second.response.create(model="gpt-4.1", input="hi")
            text = ""
            async for event in second:
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type in ("response.completed", "error"):
                    break
            assert event.type == "response.completed" and text == mock_text(TOKENS)
    await wait_for(lambda: len(sidecar.tracker.finished) == 2, what="both streams recorded")
    states = [r.meter.end_state for r in sidecar.tracker.finished]
    assert states == [EndState.CLIENT_CANCELLED, EndState.COMPLETED]
    assert record.tokens_planned == TOKENS
    # Every place went back with its session.
    await wait_for(lambda: sidecar.tracker.admitted == 0, what="every place given back")


async def test_each_response_of_a_session_is_a_server_span_of_its_own(
    mock: MockServer, start_sidecar: StartSidecar, receiver: Any
) -> None:
    from otlp_receiver import TRACE_ID, attributes, servers

    sidecar = await start_sidecar(mock.url, otel_exporter="otlp-http")
    headers = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
    async with client(sidecar.proxy_url).responses.connect(
        extra_query=FAST, extra_headers=headers
    ) as connection:
        for _ in range(2):
            await connection.response.create(model="gpt-4.1", input="hi")
            async for event in connection:
                if event.type == "response.completed":
                    break

    def streams() -> list[Any]:
        return [s for s in servers(receiver) if "streamwarden.end_state" in attributes(s)]

    await wait_for(lambda: len(streams()) == 2, what="a span per response exported")
    for span in streams():
        seen = attributes(span)
        assert span.trace_id.hex() == TRACE_ID  # under the handshake's traceparent
        assert seen["streamwarden.dialect"] == "openai-responses"
        assert seen["streamwarden.end_state"] == "completed"
        assert seen["gen_ai.usage.output_tokens"] == TOKENS


def test_a_refused_response_create_is_answered_in_its_lane_and_opens_nothing() -> None:
    # The sans-I/O model alone: with no place left, a response.create goes
    # nowhere; its refusal names the lane it asked for (events echo stream_id).
    opened: list[float] = []

    def open_stream(started_at: float, now: float) -> Relay:
        opened.append(now)
        return Relay(
            Limits(0.0, 60.0, 0.0, 1 << 20),
            started_at=started_at,
            now=now,
            path="/v1/responses",
            content_type=None,
            headers={},
            framing="messages",
        )

    refusal = refusal_message("auto", "/v1/responses", "too_many_streams", "1 streams are open")
    session = MessageSession(open_stream, lambda relay, now: None, lambda: refusal)
    create = json.dumps({"type": "response.create", "stream_id": "a"})
    reply = session.client_reply(create, 0.0)
    assert not reply.forward and not reply.opened and reply.answer is not None
    answer = json.loads(reply.answer)
    assert answer["type"] == "error" and answer["code"] == "too_many_streams"
    assert answer["error"]["code"] == "too_many_streams" and answer["stream_id"] == "a"
    assert not session.client_message(create, 0.0) and opened == [] and session.streams == []
    assert session.client_reply('{"type":"response.cancel"}', 0.0).forward  # others go on
