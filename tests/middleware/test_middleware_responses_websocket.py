"""The Responses API over an app's own WebSocket is a stream through the middleware.

A raw ASGI app answers each ``response.create`` on ``/v1/responses`` with
the SSE version's events as messages (the mock's renderings), under a real
uvicorn, read by the openai SDK's ``client.responses.connect()``. The SDK
raises on any close but 1000 and 1001 (``_iter_events`` in
``openai/_websocket_connection.py``), so directly an app that closes with
1000 half-way is a silent truncation. Through ``StreamWardenMiddleware``
every fault (that close, the app raising, silence, a giant message) reaches
the SDK as the ``error`` event and a 1011 close, the app is stopped, and
each response is a stream recorded under ``openai-responses``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs

import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from filter_streams import SECRET, TEXT, redacted_pieces, responses, split_secret
from middleware_apps import Receive, Scope, Send, serve_in_process
from streamwarden.core.meter import StreamRecord
from streamwarden.core.sse import SSEDecoder
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import mock_text
from streamwarden.tools.mock.faults import cut_index, giant_frame
from streamwarden.tools.mock.formats import WIRE_FORMATS, Answer, Frame
from streamwarden.tools.mock.tokens import mock_tokens
from waiting import wait_for

TOKENS = 8
RESPONSES = WIRE_FORMATS["openai-responses"]
PIECES = split_secret(TEXT, SECRET, 3)
#: An answer with a key split across three deltas: its events' data, one message each.
SECRET_ANSWER = [event.data for event in SSEDecoder().feed(responses(PIECES))]


class ResponsesApp:
    """Answers ``response.create`` messages; ``?fault=`` strikes half-way through each answer.

    ``close`` closes with 1000, ``return`` returns (uvicorn then drops the
    connection: 1006), ``raise`` raises, ``stall`` goes silent until
    stopped, ``giant`` makes the message at the cut ``?size=`` bytes.
    ``?answer=secret`` answers with a key split across three deltas instead.
    ``stopped`` is set once the app has returned, raised or been stopped;
    ``creates`` counts the ``response.create`` messages the app got.
    """

    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.creates = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            return
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        try:
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    return
                if json.loads(message.get("text") or "{}").get("type") != "response.create":
                    continue
                self.creates += 1
                if query.get("answer") == "secret":
                    for data in SECRET_ANSWER:
                        await send({"type": "websocket.send", "text": data})
                    continue
                if not await self._answer(send, query.get("fault"), int(query.get("size", "0"))):
                    return
        finally:
            self.stopped.set()

    async def _answer(self, send: Send, fault: str | None, size: int) -> bool:
        answer = Answer("ws", "gpt-4.1", tuple(mock_tokens(TOKENS)), 1, 0)
        frames = [
            *RESPONSES.preamble(answer),
            *(RESPONSES.token(answer, i, piece) for i, piece in enumerate(answer.pieces)),
            *RESPONSES.closing(answer),
        ]
        cut = cut_index(frames, TOKENS // 2) if fault else len(frames)
        for index, frame in enumerate(frames):
            if index == cut:
                if fault == "close":
                    await send({"type": "websocket.close", "code": 1000})
                    return False
                if fault == "return":
                    return False
                if fault == "raise":
                    raise RuntimeError("the provider broke off")
                if fault == "stall":
                    await asyncio.Event().wait()
                if fault == "giant":
                    frame = giant_frame(RESPONSES, answer, TOKENS // 2, size)
            await send({"type": "websocket.send", "text": _message(frame)})
        return True


def _message(frame: Frame) -> str:
    """An SSE event's data: the WebSocket message that carries it."""
    return next(
        line.removeprefix(b"data: ").decode()
        for line in frame.data.splitlines()
        if line.startswith(b"data: ")
    )


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=0)


async def converse(url: str, answers: int = 1, **query: str) -> tuple[list[Any], str]:
    """Ask for ``answers`` responses in one session; the events and the text. Raises as the SDK."""
    events: list[Any] = []
    text = ""
    async with asyncio.timeout(30), client(url).responses.connect(extra_query=query) as connection:
        for _ in range(answers):
            await connection.response.create(model="gpt-4.1", input="hi")
            async for event in connection:
                events.append(event)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type == "response.completed":
                    break
    return events, text


def guarded(app: ResponsesApp, **options: Any) -> StreamWardenMiddleware:
    return StreamWardenMiddleware(app, **options)


def records(middleware: StreamWardenMiddleware) -> list[StreamRecord]:
    return list(middleware.streams.finished)


async def test_directly_a_clean_close_half_way_is_silent_and_through_it_raises() -> None:
    app = ResponsesApp()
    async with serve_in_process(app) as url:
        events, text = await converse(url, fault="close")
    assert text == mock_text(TOKENS // 2)  # half an answer, and not a word about it
    assert not any(event.type in ("error", "response.completed") for event in events)

    middleware = guarded(ResponsesApp())
    async with serve_in_process(middleware) as url:
        with pytest.raises(ConnectionClosedError) as raised:
            await converse(url, fault="close")
    assert raised.value.rcvd is not None and raised.value.rcvd.code == 1011


@pytest.mark.parametrize(
    ("fault", "options", "code", "end_state"),
    [
        ("close", {}, "stream_truncated", "upstream_truncated"),
        ("return", {}, "stream_truncated", "upstream_truncated"),
        ("raise", {}, "upstream_error", "upstream_error"),
        ("stall", {"upstream_idle_timeout": "300ms"}, "upstream_timeout", "upstream_timeout"),
        ("giant", {"max_event_bytes": "64KiB"}, "event_too_large", "limit_exceeded"),
    ],
)
async def test_through_the_middleware_every_fault_raises_after_an_error_event(
    fault: str, options: dict[str, str], code: str, end_state: str
) -> None:
    app = ResponsesApp()
    middleware = guarded(app, **options)
    events: list[Any] = []
    async with serve_in_process(middleware) as url:
        query = {"fault": fault, "size": "131072"}
        with pytest.raises(ConnectionClosedError) as raised:
            async with (
                asyncio.timeout(20),
                client(url).responses.connect(extra_query=query) as connection,
            ):
                await connection.response.create(model="gpt-4.1", input="hi")
                async for event in connection:
                    events.append(event)
        await asyncio.wait_for(app.stopped.wait(), 10)  # the app was stopped, or ended
        await wait_for(lambda: len(records(middleware)) == 1, what="the stream recorded")
    assert raised.value.rcvd is not None and raised.value.rcvd.code == 1011
    error = events[-1]
    assert error.type == "error" and error.error.code == code, events[-1]
    # The partial answer went through as it came, and no terminal event.
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == mock_text(TOKENS // 2)
    (record,) = records(middleware)
    assert record.dialect == "openai-responses"
    assert record.meter.end_state == end_state and record.meter.error_code == code


async def test_whole_answers_read_the_same_through_each_a_metered_stream() -> None:
    async with serve_in_process(ResponsesApp()) as url:
        _, direct = await converse(url, answers=2)
    assert direct == mock_text(TOKENS) * 2

    middleware = guarded(ResponsesApp())
    async with serve_in_process(middleware) as url:
        events, through = await converse(url, answers=2)
        await wait_for(lambda: len(records(middleware)) == 2, what="two streams recorded")
    assert through == direct
    assert [e.type for e in events].count("response.completed") == 2
    for record in records(middleware):
        assert record.dialect == "openai-responses"
        assert record.meter.end_state == "completed"
        assert record.meter.tokens_generated == TOKENS
        assert record.meter.ttft is not None
    metrics = middleware.metrics.render().decode()
    assert 'streamwarden_streams_total{dialect="openai-responses",end_state="completed"' in metrics


async def test_a_client_that_leaves_mid_answer_stops_the_app_at_once() -> None:
    app = ResponsesApp()
    middleware = guarded(app)
    async with serve_in_process(middleware) as url:
        async with client(url).responses.connect(extra_query={"fault": "stall"}) as connection:
            await connection.response.create(model="gpt-4.1", input="hi")
            async for event in connection:
                if event.type == "response.output_text.delta":
                    break  # the answer has started: the client leaves
        # The app, silent mid-answer and never reading, is stopped.
        await asyncio.wait_for(app.stopped.wait(), 10)
        await wait_for(lambda: len(records(middleware)) == 1, what="the stream recorded")
    (record,) = records(middleware)
    assert record.dialect == "openai-responses"
    assert record.meter.end_state == "client_cancelled"
    assert record.meter.cancel_propagation is not None


async def test_only_the_responses_path_is_read_other_websockets_pass_untouched() -> None:
    middleware = guarded(ResponsesApp())
    create = json.dumps({"type": "response.create", "model": "gpt-4.1", "input": "hi"})
    async with serve_in_process(middleware) as url:
        base = url.replace("http://", "ws://")
        # Elsewhere the same half answer and its clean close pass as they came.
        async with connect(f"{base}/socket?fault=close") as websocket:
            await websocket.send(create)
            received = [json.loads(message) async for message in websocket]
        assert websocket.close_code == 1000
        assert received[-1]["type"] == "response.output_text.delta"
        # On /v1/responses the session is read: the cut is told.
        async with connect(f"{base}/v1/responses?fault=close") as websocket:
            await websocket.send(create)
            with pytest.raises(ConnectionClosedError):
                async for message in websocket:
                    received.append(json.loads(message))
        assert websocket.close_code == 1011 and received[-1]["type"] == "error"
    assert len(records(middleware)) == 1  # the one on /v1/responses


async def test_a_session_is_guarded_as_the_sidecars_filters_and_the_stream_limit() -> None:
    # Directly the key goes out whole; through, redacted, as over SSE.
    async with serve_in_process(ResponsesApp()) as url:
        _, direct = await converse(url, answer="secret")
    assert direct == TEXT
    app = ResponsesApp()
    redact = [{"builtin": "secrets", "action": "redact"}]
    middleware = guarded(app, output_filters=redact, max_concurrent_streams="1")
    async with serve_in_process(middleware) as url:
        _, through = await converse(url, answer="secret")
        assert through == "".join(redacted_pieces(PIECES, SECRET))
        await wait_for(lambda: len(records(middleware)) == 1, what="the stream recorded")

        # One response mid-answer holds the one place: another is refused, and
        # its response.create never reaches the app; the session goes on.
        connect = client(url).responses.connect
        async with connect(extra_query={"fault": "stall"}) as first:
            await first.response.create(model="gpt-4.1", input="hi")
            async for event in first:
                if event.type == "response.output_text.delta":
                    break
            async with connect() as second:
                await second.response.create(model="gpt-4.1", input="hi")
                event = await second.recv()
                assert event.type == "error" and event.error.code == "too_many_streams", event
                assert app.creates == 2  # the secret answer's and the first's
                await first.close()  # its place goes back as its stream is recorded
                await wait_for(lambda: len(records(middleware)) == 2, what="the first recorded")
                await second.response.create(model="gpt-4.1", input="hi")
                text = ""
                async for event in second:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                    if event.type in ("response.completed", "error"):
                        break
                assert event.type == "response.completed" and text == mock_text(TOKENS)
        await wait_for(lambda: middleware.streams.admitted == 0, what="every place given back")
