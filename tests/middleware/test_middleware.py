"""StreamWardenMiddleware in a real FastAPI/Starlette app, served by uvicorn on loopback.

The app here is what users write: a FastAPI endpoint that relays a
provider's stream (the mock upstream) with ``StreamingResponse``. The
official ``openai`` SDK is the client. Each behaviour is shown first on
the app as it is, then with ``app.add_middleware(StreamWardenMiddleware)``.
The server-specific behaviours (cancellation timing, keep-alive timing
under uvicorn, hypercorn and granian) are in ``test_middleware_servers.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from broken import read_broken
from middleware_apps import FINALLY_DIR_ENV, raw_app
from middleware_apps import serve_in_process as serve
from streamwarden.config import ConfigError
from streamwarden.core.relay import KEEPALIVE
from streamwarden.core.sse import SSEDecoder
from streamwarden.middleware import StreamWardenMiddleware, mount_metrics
from streamwarden.tools.mock import MockServer
from waiting import wait_for

FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "30"}
CHAT = [{"role": "user", "content": "hi"}]


def start(content_type: str, status: int = 200) -> dict[str, Any]:
    """An ``http.response.start`` message."""
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type.encode())],
    }


def chunk(body: bytes, more: bool = True) -> dict[str, Any]:
    """An ``http.response.body`` message."""
    return {"type": "http.response.body", "body": body, "more_body": more}


# -- a real server, in this process ---------------------------------------------------


class Captured(logging.Handler):
    """Records of one logger, whatever the rest of the process did to logging."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def middleware_log() -> AsyncIterator[Captured]:
    logger = logging.getLogger("streamwarden.middleware")
    handler = Captured()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler  # type: ignore[misc]
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def finally_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(FINALLY_DIR_ENV, str(tmp_path))
    return tmp_path


# -- the app users write -------------------------------------------------------------


def relay_app(provider: str, *, guarded: bool, **options: Any) -> FastAPI:
    """A FastAPI app that relays its provider's chat stream, as many apps do."""
    app = FastAPI()
    if guarded:
        app.add_middleware(StreamWardenMiddleware, **options)
        mount_metrics(app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.body()
        client = httpx.AsyncClient(base_url=provider, timeout=None)
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-mock-")}
        upstream = await client.send(
            client.build_request(
                "POST",
                "/v1/chat/completions",
                content=body,
                headers={**headers, "content-type": "application/json"},
            ),
            stream=True,
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                # Closing the provider's response is what stops the generation.
                await upstream.aclose()
                await client.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    return app


async def openai_text(base_url: str, **headers: str) -> str:
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key="test",
        max_retries=0,
        timeout=10.0,
        default_headers=headers,
    )
    text = ""
    try:
        stream = await client.chat.completions.create(
            model="mock",
            messages=CHAT,  # type: ignore[arg-type]
            stream=True,
        )
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
    finally:
        await client.close()
    return text


def _middleware(app: Any) -> StreamWardenMiddleware:
    """The middleware instance Starlette built for ``app``."""
    stack = app.middleware_stack
    while stack is not None and not isinstance(stack, StreamWardenMiddleware):
        stack = getattr(stack, "app", None)
    assert isinstance(stack, StreamWardenMiddleware)
    return stack


# -- honest endings through the openai SDK ---------------------------------------------


async def test_openai_sdk_gets_the_same_answer_through_the_middleware(mock: MockServer) -> None:
    async with serve(relay_app(mock.url, guarded=False)) as plain:
        direct = await openai_text(plain, **FAST)
    app = relay_app(mock.url, guarded=True)
    async with serve(app) as guarded:
        assert await openai_text(guarded, **FAST) == direct
    assert direct
    (record,) = _middleware(app).streams.finished
    assert record.meter.end_state == "completed"
    assert record.dialect == "openai-chat"


async def test_truncated_stream_is_silent_without_and_an_api_error_with(mock: MockServer) -> None:
    cut = {**FAST, "x-mock-fault": "truncate"}
    async with serve(relay_app(mock.url, guarded=False)) as plain:
        # The problem: the generator ends without [DONE]; the SDK returns half an answer.
        assert await openai_text(plain, **cut)
    app = relay_app(mock.url, guarded=True)
    async with serve(app) as guarded:
        with pytest.raises(openai.APIError) as caught:
            await openai_text(guarded, **cut)
    assert caught.value.code == "stream_truncated"
    (record,) = _middleware(app).streams.finished
    assert record.meter.end_state == "upstream_truncated"


async def test_app_raising_mid_stream_is_a_broken_connection_without_and_an_api_error_with(
    mock: MockServer, middleware_log: Captured
) -> None:
    # The provider resets the connection mid-stream, so the app's generator raises.
    reset = {**FAST, "x-mock-fault": "reset"}
    async with serve(relay_app(mock.url, guarded=False)) as plain:
        with pytest.raises(openai.APIConnectionError):
            await openai_text(plain, **reset)
        with pytest.raises(httpx.RemoteProtocolError):  # no chunked terminator
            await _read_body(plain, reset)
    app = relay_app(mock.url, guarded=True)
    async with serve(app) as guarded:
        with pytest.raises(openai.APIError) as caught:
            await openai_text(guarded, **reset)
        assert not isinstance(caught.value, openai.APIConnectionError)
        assert caught.value.code == "upstream_error"
        # The body ends cleanly, with the error event last.
        body = await _read_body(guarded, reset)
    events = SSEDecoder().feed(body)
    assert json.loads(events[-1].data)["error"]["code"] == "upstream_error"
    # The app's exception is logged with its traceback, not lost.
    errors = [r for r in middleware_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert all(r.exc_info and isinstance(r.exc_info[1], httpx.TransportError) for r in errors)
    assert "upstream_error" in errors[0].getMessage()
    states = [r.meter.end_state for r in _middleware(app).streams.finished]
    assert states == ["upstream_error", "upstream_error"]


async def _read_body(base_url: str, headers: dict[str, str]) -> bytes:
    async with httpx.AsyncClient(timeout=10.0) as client:
        response = await client.post(
            base_url + "/v1/chat/completions",
            json={"model": "mock", "messages": CHAT, "stream": True},
            headers=headers,
        )
        return response.content


async def test_disconnect_closes_the_apps_provider_stream_at_once(mock: MockServer) -> None:
    # The provider goes silent after 5 tokens, for ever; the client leaves; the
    # provider must see its connection closed (so it would stop generating)
    # while it is silent: a middleware that noticed only on the next write
    # would never close it, as that write never comes.
    stall = {**FAST, "x-mock-fault": "stall", "x-mock-fault-after": "5"}
    app = relay_app(mock.url, guarded=True)
    async with serve(app) as guarded:
        request_id = uuid.uuid4().hex
        host, port = guarded.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true}'
        extra = "".join(f"{k}: {v}\r\n" for k, v in stall.items())
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nx-mock-request-id: {request_id}\r\n"
            f"{extra}content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        seen = b""
        async with asyncio.timeout(5):
            while seen.count(b"data: ") < 5:
                seen += await reader.read(4096)
        record = mock.stats.get(request_id)
        assert record is not None and record.closed_at is None
        writer.close()
        await wait_for(lambda: record.closed_at is not None, what="the provider's close")
        assert record.closed_early and not record.completed
        assert record.tokens_generated == 5  # closed in its silence: nothing written after
        await wait_for(lambda: bool(_middleware(app).streams.finished))
    (stream,) = _middleware(app).streams.finished
    assert stream.meter.end_state == "client_cancelled"
    assert stream.meter.cancel_propagation is not None  # measured (its speed: bench/)


# -- headers ---------------------------------------------------------------------------


async def _preset_headers_app(scope: Any, receive: Any, send: Any) -> None:
    body = b"data: one\n\n"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"private"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def test_streamed_responses_leave_with_the_no_buffering_headers() -> None:
    async with serve(_preset_headers_app) as plain, httpx.AsyncClient() as client:
        response = await client.get(plain + "/")
        assert response.headers["cache-control"] == "private"
        assert "x-accel-buffering" not in response.headers
        assert response.headers["content-length"] == "11"
    guarded_app = StreamWardenMiddleware(_preset_headers_app)
    async with serve(guarded_app) as guarded, httpx.AsyncClient() as client:
        response = await client.get(guarded + "/")
    assert response.headers["cache-control"] == "private, no-cache, no-transform"
    assert response.headers["x-accel-buffering"] == "no"
    assert "content-length" not in response.headers
    assert response.headers["transfer-encoding"] == "chunked"
    assert response.content == b"data: one\n\n"


def _plain_routes_app(guarded: bool) -> Starlette:
    async def data(request: Any) -> JSONResponse:
        return JSONResponse({"answer": 42, "items": list(range(100))}, headers={"x-app": "1"})

    async def text(request: Any) -> PlainTextResponse:
        return PlainTextResponse("x" * 100_000)

    async def chunks(request: Any) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(50):
                yield f"line {i}\n".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    app = Starlette(routes=[Route("/data", data), Route("/text", text), Route("/chunks", chunks)])
    if guarded:
        app.add_middleware(StreamWardenMiddleware)
    return app


async def test_other_responses_pass_through_untouched() -> None:
    async def fetch(base: str) -> list[tuple[int, list[tuple[str, str]], bytes]]:
        results = []
        async with httpx.AsyncClient() as client:
            for path in ("/data", "/text", "/chunks"):
                response = await client.get(base + path)
                headers = [(k, v) for k, v in response.headers.multi_items() if k != "date"]
                results.append((response.status_code, headers, response.content))
        return results

    async with serve(_plain_routes_app(False)) as plain:
        expected = await fetch(plain)
    app = _plain_routes_app(True)
    async with serve(app) as guarded:
        assert await fetch(guarded) == expected
    assert not _middleware(app).streams.finished  # none of them was taken for a stream


# -- the app's own receive() -------------------------------------------------------------


async def _echo_after_start(scope: Any, receive: Any, send: Any) -> None:
    """Starts its stream first, then reads the request body: the watcher got there first."""
    await send(start("text/event-stream"))
    # The stimulus: an app busy elsewhere before it reads, while the disconnect
    # watcher pulls the body (if it does not in time, the body is simply read
    # straight from the server).
    await asyncio.sleep(0.1)
    size, more = 0, True
    while more:
        message = await receive()
        assert message["type"] == "http.request"
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    await send({"type": "http.response.body", "body": f"data: {size}\n\n".encode()})


async def test_the_request_body_reaches_the_app_even_after_its_stream_started() -> None:
    payload = b"y" * 300_000
    async with serve(StreamWardenMiddleware(_echo_after_start)) as guarded:
        async with httpx.AsyncClient() as client:
            response = await client.post(guarded + "/", content=payload)
    assert response.content == b"data: 300000\n\n"


async def test_the_apps_own_disconnect_checks_still_work() -> None:
    seen = asyncio.Event()
    checking = asyncio.Event()

    async def slow(request: Request) -> JSONResponse:
        # A long, non-streamed request that checks for its client itself, until
        # it sees it gone: a middleware that hid the disconnect keeps it here.
        checking.set()
        while not await request.is_disconnected():
            await asyncio.sleep(0.01)  # the app's own polling pace
        seen.set()
        return JSONResponse({})

    app = Starlette(routes=[Route("/slow", slow)])
    app.add_middleware(StreamWardenMiddleware)
    async with serve(app) as guarded:
        host, port = guarded.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        async with asyncio.timeout(5):
            await checking.wait()  # the app is running, watching its client
        writer.close()
        async with asyncio.timeout(10):
            await seen.wait()


# -- exceptions before the start, other scopes ------------------------------------------


async def test_exceptions_before_the_response_started_propagate() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("before any response")

    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [], "query_string": b""}
    with pytest.raises(ValueError, match="before any response"):
        await StreamWardenMiddleware(broken)(scope, receive, send)
    assert sent == []


async def test_non_http_scopes_pass_straight_through() -> None:
    calls: list[tuple[Any, Any, Any]] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        calls.append((scope, receive, send))

    async def receive() -> dict[str, Any]:
        return {}

    async def send(message: Any) -> None:
        return None

    middleware = StreamWardenMiddleware(inner)
    for kind in ("lifespan", "websocket"):
        scope = {"type": kind}
        await middleware(scope, receive, send)
        assert calls[-1] == (scope, receive, send)
        assert "streamwarden" not in scope


# -- timers and limits -------------------------------------------------------------------


async def test_a_silent_app_gets_the_idle_timeout_error_and_is_stopped(finally_dir: Path) -> None:
    request_id = uuid.uuid4().hex
    app = StreamWardenMiddleware(raw_app, upstream_idle_timeout=0.3, keepalive_interval=0.1)
    # The app is silent for 30 s, past the client's 10 s: only the idle timeout ends it.
    async with serve(app) as guarded, httpx.AsyncClient(timeout=10.0) as client:
        # A generic stream: after its error event, its body breaks (never quieter).
        body = await read_broken(client, "GET", f"{guarded}/silent?id={request_id}")
    events = SSEDecoder().feed(body)
    assert [e.event for e in events] == ["message", "error"]
    assert "upstream_timeout" in events[-1].data
    assert (finally_dir / request_id).exists()  # the app's wait was cancelled
    (record,) = app.streams.finished
    assert record.meter.end_state == "upstream_timeout"
    # Keep-alives do not reset the idle timer (3 intervals of 0.1 s in 0.3 s):
    # not cut before two were written.
    assert record.meter.keepalives >= 2


async def test_an_event_over_the_limit_ends_the_stream_and_stops_the_app() -> None:
    stopped = asyncio.Event()

    async def chatty(scope: Any, receive: Any, send: Any) -> None:
        await send(start("text/event-stream"))
        try:
            await send(chunk(b"data: ok\n\n"))
            await send(chunk(b"data: " + b"z" * 5000 + b"\n\n"))
            await asyncio.sleep(30)
        finally:
            stopped.set()

    app = StreamWardenMiddleware(chatty, max_event_bytes="1KiB")
    async with serve(app) as guarded, httpx.AsyncClient(timeout=5.0) as client:
        body = await read_broken(client, "GET", guarded + "/")
        async with asyncio.timeout(1):
            await stopped.wait()
    events = SSEDecoder().feed(body)
    assert events[0].data == "ok"
    assert "event_too_large" in events[-1].data
    assert app.streams.finished[0].meter.end_state == "limit_exceeded"


async def test_line_framed_streams_get_no_keepalives() -> None:
    # The NDJSON app stays quiet until an event stream of the same middleware,
    # quiet since after it, has had two keep-alives.
    witnessed = asyncio.Event()

    async def app_of(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/witness":
            await send(start("text/event-stream"))
            await send(chunk(b"data: a\n\n"))
            await witnessed.wait()
            await send(chunk(b"data: b\n\n", more=False))
            return
        await send(start("application/x-ndjson"))
        await send(chunk(b'{"response": "a"}\n'))
        await witnessed.wait()
        await send(chunk(b'{"response": "b", "done": true}\n', more=False))

    async def witness(client: httpx.AsyncClient, base: str) -> None:
        async with client.stream("GET", base + "/witness") as stream:
            seen = b""
            async for part in stream.aiter_raw():
                seen += part
                if seen.count(KEEPALIVE) == 2:
                    witnessed.set()

    app = StreamWardenMiddleware(app_of, keepalive_interval=0.1)
    async with serve(app) as guarded, httpx.AsyncClient(timeout=10.0) as client:
        async with client.stream("GET", guarded + "/api/generate") as ndjson:
            parts = ndjson.aiter_raw()
            first = await anext(parts)  # the NDJSON stream is quiet from here on
            await witness(client, guarded)
            rest = b"".join([part async for part in parts])
    response_content = first + rest
    assert KEEPALIVE not in response_content
    assert response_content == b'{"response": "a"}\n{"response": "b", "done": true}\n'
    assert [r.meter.end_state for r in app.streams.finished] == ["completed", "completed"]


async def test_a_client_that_stops_reading_is_cut_and_the_app_stopped() -> None:
    """The app is stuck in send() while the client reads nothing: without the
    middleware it stays stuck; with it, the keep-alive timer notices the write
    has waited ``client_write_timeout`` and cancels the app. Both apps meet
    the same stalled client, the bare one first; the guarded one is cut while
    the bare one, stalled longer, is still stuck."""
    finished: set[str] = set()

    async def firehose(scope: Any, receive: Any, send: Any) -> None:
        await send(start("text/event-stream"))
        try:
            for _ in range(10_000):
                await send(chunk(b"data: " + b"x" * 65536 + b"\n\n"))
        finally:
            finished.add(scope["path"])

    async def stall_client(base: str, path: str) -> socket.socket:
        host, port = base.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        sock.send(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        return sock

    app = StreamWardenMiddleware(firehose, keepalive_interval=0.2, client_write_timeout=0.3)
    async with serve(firehose) as plain, serve(app) as guarded:
        bare_client = await stall_client(plain, "/bare")
        # 640 MiB to a client that reads nothing: only a cut ends either app.
        guarded_client = await stall_client(guarded, "/guarded")
        await wait_for(lambda: "/guarded" in finished, what="the guarded app stopped")
        assert "/bare" not in finished  # still blocked in send()
        bare_client.close()
        guarded_client.close()
    assert app.streams.finished[0].meter.end_state == "client_too_slow"


async def test_a_server_shutdown_ends_the_stream_with_an_error_event() -> None:
    app = StreamWardenMiddleware(raw_app, keepalive_interval=0.2)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
        timeout_graceful_shutdown=0.3,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    body = b""
    with pytest.raises(httpx.RemoteProtocolError):  # a generic stream's error breaks its body
        async with (
            httpx.AsyncClient(timeout=5.0) as client,
            client.stream("GET", f"http://127.0.0.1:{port}/silent") as response,
        ):
            async for part in response.aiter_raw():
                body += part
                if b"data: first" in body and not server.should_exit:
                    # uvicorn cancels the request once its graceful timeout runs out.
                    server.should_exit = True
    await asyncio.wait_for(task, 5)
    events = SSEDecoder().feed(body)
    assert events[-1].event == "error" and "shutting_down" in events[-1].data
    assert app.streams.finished[0].meter.end_state == "shutdown"


async def test_a_client_leaving_during_the_server_shutdown_stops_the_app_at_once() -> None:
    """The graceful timeout is 5 s; the client's leaving, not the timeout, ends the app."""
    app = StreamWardenMiddleware(raw_app, keepalive_interval=0.2)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
        timeout_graceful_shutdown=5,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(10):
        while not server.started:
            await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"GET /silent HTTP/1.1\r\nHost: x\r\n\r\n")
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    received = b""
    async with asyncio.timeout(5):
        while b"data: first" not in received:
            received += await loop.sock_recv(sock, 4096)
    server.should_exit = True  # the server starts its graceful shutdown ...
    # ... on its next tick: its first step is to close its listening socket.
    await wait_for(lambda: not server.servers[0].is_serving(), what="uvicorn shutting down")
    assert not task.done()  # the open stream holds the shutdown
    sock.close()  # the client leaves during it
    await asyncio.wait_for(task, 10)
    [record] = app.streams.finished
    # Cancelled for its client, not cut by the graceful timeout (that is `shutdown`).
    assert record.meter.end_state == "client_cancelled"


async def test_a_background_task_after_the_stream_is_left_alone() -> None:
    stream_over = asyncio.Event()
    done = asyncio.Event()

    async def after() -> None:
        await stream_over.wait()  # still running after the stream has ended
        done.set()

    async def stream(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"data: one\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", background=BackgroundTask(after)
        )

    app = Starlette(routes=[Route("/", stream)])
    app.add_middleware(StreamWardenMiddleware)
    async with serve(app) as guarded, httpx.AsyncClient(timeout=5.0) as client:
        response = await client.get(guarded + "/")
        stream_over.set()  # the client has the whole body
        async with asyncio.timeout(10):
            await done.wait()
    assert response.content == b"data: one\n\n"
    assert _middleware(app).streams.finished[0].meter.end_state == "completed"


# -- metrics -------------------------------------------------------------------------------


async def test_metrics_are_served_by_the_app_or_by_the_middleware(mock: MockServer) -> None:
    app = relay_app(mock.url, guarded=True, metrics_path="/sw-metrics")
    async with serve(app) as guarded:
        await openai_text(guarded, **FAST)
        with pytest.raises(openai.APIError):
            await openai_text(guarded, **FAST, **{"x-mock-fault": "truncate"})
        async with httpx.AsyncClient() as client:
            mounted = await client.get(guarded + "/metrics")  # mount_metrics(app)
            served = await client.get(guarded + "/sw-metrics")  # the metrics_path option
    for response in (mounted, served):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        text = response.text
        assert (
            'streamwarden_streams_total{dialect="openai-chat",end_state="completed",route="/"} 1.0'
            in text
        )
        assert 'end_state="upstream_truncated"' in text
        assert 'streamwarden_synthesized_errors_total{code="stream_truncated"} 1.0' in text
        assert "streamwarden_active_streams 0.0" in text


async def test_the_metrics_endpoint_says_when_no_middleware_is_in_front() -> None:
    app = Starlette()
    mount_metrics(app)
    async with serve(app) as plain, httpx.AsyncClient() as client:
        response = await client.get(plain + "/metrics")
    assert response.status_code == 503


# -- configuration ---------------------------------------------------------------------------


def test_options_take_config_keys_and_fall_back_to_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    monkeypatch.setenv("STREAMWARDEN_UPSTREAM_IDLE_TIMEOUT", "2m")
    middleware = StreamWardenMiddleware(app, keepalive_interval="1s", max_event_bytes="64KiB")
    assert middleware.settings.keepalive_interval == 1.0
    assert middleware.settings.max_event_bytes == 64 * 1024
    assert middleware.settings.upstream_idle_timeout == 120.0
    assert StreamWardenMiddleware(app, keepalive_interval=2.5).settings.keepalive_interval == 2.5
    defaults = StreamWardenMiddleware(app).settings
    assert defaults.keepalive_interval == 15.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keepalive_interval": "soon"}, 'keepalive_interval: "soon" is not a duration'),
        ({"keepalive_intervall": 1}, 'did you mean "keepalive_interval"'),
    ],
)
def test_a_bad_option_fails_at_construction(options: dict[str, Any], message: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    with pytest.raises(ConfigError, match=message):
        StreamWardenMiddleware(app, **options)


def test_the_middleware_does_not_import_aiohttp() -> None:
    code = (
        "import sys, streamwarden.middleware; "
        "bad = [m for m in ('aiohttp', 'starlette') if m in sys.modules]; "
        "sys.exit(', '.join(bad) or None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
