"""The mock's aiohttp server: routing, pacing, fault injection, and accounting.

This is the I/O half of the mock. A request is routed to a wire format by
its path (:func:`~streamwarden.tools.mock.formats.format_for_path`; other paths
get the settings' default format), its controls are parsed, and the answer
the format rendered is replayed frame by frame: headers at once, the
preamble, then one token frame per tick (``ttft`` before the first, ``1/tps``
apart, on an absolute schedule so pacing does not drift), then the closing
frames. A fault, if any, strikes at the cut point the :mod:`.faults` module
computed. Every byte goes through one :class:`_Writer`, which is also the
only place tokens are counted, so ``tokens_generated`` is exactly the
number of token frames the transport accepted.

Client disconnects are noticed two ways, and both are recorded: the server
runs with ``handler_cancellation=True``, so aiohttp cancels the handler as
soon as the connection is lost, even while the mock is silent (a stall, a
long gap, a slow header); and a write that fails with a connection error
means the same thing. Cancellation caused by the mock's own shutdown is not
counted as a client leaving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import socket
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from streamwarden.tools.mock.controls import ControlError, Controls, MockSettings, parse_controls
from streamwarden.tools.mock.faults import (
    DEFAULT_HEADER_DELAY,
    Fault,
    cut_index,
    garbage_chunk,
    giant_frame,
)
from streamwarden.tools.mock.formats import (
    WIRE_FORMATS,
    Answer,
    Frame,
    WireFormat,
    format_for_path,
    wire_format,
)
from streamwarden.tools.mock.stats import MockStats, RequestRecord
from streamwarden.tools.mock.tokens import mock_tokens, tool_call_fragments
from streamwarden.tools.probe.measure import send_stamp

__all__ = ["MockServer", "create_app", "start_mock"]

_BODY_LIMIT = 64 * 1024 * 1024
# Large frames (giant-event) go out in slices, as a real upstream's writes
# would, so a relay sees the event arrive over many reads.
_SLICE = 64 * 1024
_GARBAGE_CHUNK_BYTES = 48
_SHUTDOWN_TIMEOUT = 1.0
# Bytes that cannot start an HTTP/1.1 chunk: a chunk-size line is hex digits.
_BROKEN_CHUNK = b"zz; this is not a chunk size\r\n"
# Close codes a peer may not send in a close frame (RFC 6455, section 7.4.1).
_RESERVED_CLOSE_CODES = frozenset({1004, 1005, 1006, 1015})


@dataclass(eq=False)
class _MockState:
    """Per-application state: settings, records, and the handlers in flight."""

    settings: MockSettings
    stats: MockStats
    active: dict[asyncio.Task[Any], RequestRecord] = field(default_factory=dict)
    shutting_down: bool = False
    engine: EngineCounters = field(default_factory=lambda: EngineCounters())
    #: Generations that go on after their client left (``--no-abort``).
    zombies: set[asyncio.Task[None]] = field(default_factory=set)


@dataclass
class EngineCounters:
    """What an inference engine would export: tokens generated, requests running."""

    generated: int = 0
    running: int = 0

    def render(self, engine: str) -> str:
        """``GET /metrics`` in the engine's own Prometheus names."""
        if engine == "sglang":
            names = ("sglang:generation_tokens_total", "sglang:num_running_reqs")
        else:
            names = ("vllm:generation_tokens_total", "vllm:num_requests_running")
        counter, gauge = names
        labels = '{model_name="mock"}'
        return (
            f"# HELP {counter} Number of generation tokens processed.\n"
            f"# TYPE {counter} counter\n"
            f"{counter}{labels} {float(self.generated)}\n"
            f"# HELP {gauge} Number of requests currently running.\n"
            f"# TYPE {gauge} gauge\n"
            f"{gauge}{labels} {float(self.running)}\n"
        )


_STATE = web.AppKey("streamwarden_mock_state", _MockState)


class _ClientGone(Exception):
    """A write failed because the client went away; the record already says so."""


def create_app(settings: MockSettings | None = None) -> web.Application:
    """Build the mock's aiohttp application.

    Run it with ``handler_cancellation=True`` (as :func:`start_mock` does);
    without it a silent handler never learns that its client left.
    """
    app = web.Application(client_max_size=_BODY_LIMIT)
    app[_STATE] = _MockState(settings or MockSettings(), MockStats())
    app.router.add_get("/_mock/stats", _handle_stats)
    app.router.add_get("/metrics", _handle_engine_metrics)
    app.router.add_post("/_mock/reset", _handle_reset)
    app.router.add_get("/ws", _handle_websocket)
    app.router.add_route("*", "/echo", _handle_echo)
    app.router.add_route("*", "/echo/{tail:.*}", _handle_echo)
    app.router.add_route("*", "/{tail:.*}", _handle_model)
    app.on_shutdown.append(_cancel_active)
    return app


def app_stats(app: web.Application) -> MockStats:
    """The records of an application made by :func:`create_app`."""
    return app[_STATE].stats


class MockServer:
    """A running mock upstream on a TCP port."""

    def __init__(self, runner: web.AppRunner, app: web.Application, host: str, port: int) -> None:
        self._runner = runner
        self.app = app
        """The aiohttp application being served."""
        self.host = host
        """The address the server listens on."""
        self.port = port
        """The port the server listens on (the real one when 0 was asked for)."""
        self.stats: MockStats = app_stats(app)
        """The per-request records."""
        self.settings: MockSettings = app[_STATE].settings
        """The server-wide defaults."""
        bracketed = f"[{host}]" if ":" in host else host
        self.url = f"http://{bracketed}:{port}"
        """The base URL, without a trailing slash: ``http://127.0.0.1:PORT``."""

    async def close(self) -> None:
        """Stop listening, end every request in flight, and release the port."""
        await self._runner.cleanup()

    async def __aenter__(self) -> MockServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def start_mock(
    host: str = "127.0.0.1", port: int = 0, settings: MockSettings | None = None
) -> MockServer:
    """Start a mock upstream on ``host:port`` (0 picks a free port) and return it."""
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_SHUTDOWN_TIMEOUT)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = int(runner.addresses[0][1])
    except BaseException:
        await runner.cleanup()
        raise
    return MockServer(runner, app, host, bound_port)


async def _cancel_active(app: web.Application) -> None:
    # Stalled handlers would otherwise hold the shutdown for its whole timeout.
    state = app[_STATE]
    state.shutting_down = True
    for task in list(state.active) + list(state.zombies):
        task.cancel()


async def _handle_engine_metrics(request: web.Request) -> web.Response:
    state = request.app[_STATE]
    text = state.engine.render(state.settings.engine)
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def _generate_for_nobody(engine: EngineCounters, tokens: int, pace: float) -> None:
    """``--no-abort``: the rest of an answer whose client left, at the same pace."""
    try:
        for _ in range(tokens):
            if pace > 0:
                await asyncio.sleep(pace)  # the simulated model's pace
            engine.generated += 1
    finally:
        engine.running -= 1


@contextlib.contextmanager
def _watching(state: _MockState, record: RequestRecord) -> Iterator[None]:
    """Track a handler while it runs; record a cancellation as the client leaving."""
    task = asyncio.current_task()
    if task is not None:
        state.active[task] = record
    engine = state.engine
    engine.running += 1
    record.engine = engine
    try:
        yield
    except asyncio.CancelledError:
        # handler_cancellation: aiohttp cancels the handler when the
        # connection is lost, which is the only way to notice it while silent.
        if not state.shutting_down:
            record.note_client_gone(time.monotonic())
        raise
    finally:
        if task is not None:
            state.active.pop(task, None)
        record.ended_at = time.monotonic()
        left = record.tokens_planned - record.tokens_generated
        if (
            record.closed_early
            and left > 0
            and not state.settings.abort_on_disconnect
            and not state.shutting_down
        ):
            pace = 1 / tps if (tps := state.settings.tokens_per_second) > 0 else 0.0
            zombie = asyncio.get_running_loop().create_task(
                _generate_for_nobody(engine, left, pace)
            )
            state.zombies.add(zombie)
            zombie.add_done_callback(state.zombies.discard)
        else:
            engine.running -= 1


class _Writer:
    """The single path for bytes of a streamed response, and the token counter."""

    def __init__(self, response: web.StreamResponse, record: RequestRecord) -> None:
        self._response = response
        self._record = record

    async def start(self, request: web.Request) -> None:
        try:
            await self._response.prepare(request)
        except ConnectionError as exc:
            self._record.note_client_gone(time.monotonic())
            raise _ClientGone from exc
        self._record.status = self._response.status

    async def write(self, data: bytes, tokens: int = 0) -> None:
        """Write ``data``; count ``tokens`` only once all of it was accepted."""
        view = memoryview(data)
        try:
            for offset in range(0, len(view), _SLICE):
                await self._response.write(view[offset : offset + _SLICE])
        except ConnectionError as exc:
            self._record.note_client_gone(time.monotonic())
            raise _ClientGone from exc
        self._record.tokens_generated += tokens
        engine = self._record.engine
        if engine is not None:
            engine.generated += tokens


class _Pacer:
    """The token schedule: ``ttft`` then ``1/tps`` per token, from a fixed origin."""

    def __init__(self, ttft: float, tokens_per_second: float, ping: bytes | None) -> None:
        self._loop = asyncio.get_running_loop()
        self._ttft = ttft
        self._gap = 1.0 / tokens_per_second if tokens_per_second else 0.0
        self._ping = ping
        self._origin = self._loop.time()
        self._count = 0

    def restart(self) -> None:
        """Count the schedule from now (the headers just went out)."""
        self._origin = self._loop.time()

    def resume(self) -> None:
        """Make the next token due now, after a stall with a delay."""
        self._origin = self._loop.time() - self._ttft - self._count * self._gap

    async def next_token(self, writer: _Writer) -> None:
        """Wait until the next token is due, pinging halfway if asked to."""
        due = self._origin + self._ttft + self._count * self._gap
        self._count += 1
        if self._ping is not None and due > self._loop.time():
            await self._sleep_until((self._loop.time() + due) / 2)
            await writer.write(self._ping)
        await self._sleep_until(due)

    async def _sleep_until(self, deadline: float) -> None:
        # Sleep even when already due, so an unpaced stream still lets other
        # connections (and cancellation) in between its tokens.
        await asyncio.sleep(max(deadline - self._loop.time(), 0.0))


def _error_response(fmt: WireFormat, status: int, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=fmt.error(status, message),
        content_type=None,
        headers={"Content-Type": fmt.error_content_type},
    )


def _json_object(raw: bytes) -> dict[str, Any]:
    # Lenient on purpose: tests post odd bodies through proxies, and the mock's
    # job is to answer them, not to validate requests like the provider would.
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _broken_after(controls: Controls) -> int:
    """How many argument fragments ``broken-tool-call`` sends (at least one)."""
    return controls.fault_after if controls.fault_after is not None else controls.tokens // 2


def _streams_arguments(body: Mapping[str, Any]) -> bool:
    """Gemini on Vertex AI: the request asks for a call's arguments streamed."""
    config = body.get("toolConfig", body.get("tool_config"))
    calling = config.get("functionCallingConfig") if isinstance(config, dict) else None
    return isinstance(calling, dict) and calling.get("streamFunctionCallArguments") is True


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _problem(
    fmt: WireFormat, controls: Controls, streamed: bool, request: web.Request
) -> str | None:
    """Why this request cannot be answered as asked, or ``None``."""
    problem = fmt.request_problem(request.path, request.query)
    if problem is not None:
        return problem
    if controls.tool_call and not fmt.supports_tool_call:
        supported = ", ".join(name for name, f in WIRE_FORMATS.items() if f.supports_tool_call)
        return f"tool-call is supported by {supported}, not {fmt.name}"
    fault = controls.fault
    if fault is None:
        return None
    if fault is Fault.BROKEN_TOOL_CALL and not (
        controls.tool_call and 0 < _broken_after(controls) < controls.tokens
    ):
        return "fault broken-tool-call needs tool-call=1 and fault-after between 1 and tokens - 1"
    if not streamed and not fault.applies_to_whole_replies:
        return f"fault {fault} needs a streamed answer; this request asks for a whole reply"
    if fault.needs_sse and not fmt.is_sse:
        return f"fault {fault} needs a server-sent events stream; {fmt.name} is line-based"
    if fault is Fault.GIANT_EVENT and controls.tokens == 0:
        return "fault giant-event needs at least one token"
    return None


async def _handle_model(request: web.Request) -> web.StreamResponse:
    """Every path that is not echo, WebSocket or admin: answer like a model."""
    state = request.app[_STATE]
    if request.path.startswith("/_mock/"):
        raise web.HTTPNotFound()
    matched = format_for_path(request.path)
    fmt = matched or wire_format(state.settings.dialect)
    try:
        controls = parse_controls(request.headers, request.query, state.settings)
    except ControlError as exc:
        return _error_response(fmt, 400, f"streamwarden mock: {exc}")
    if fmt.name == "openai-responses" and request.headers.get("Upgrade", "").lower() == "websocket":
        return await _handle_responses_websocket(request, fmt, controls)
    raw = await request.read()
    body = _json_object(raw)
    if matched is None:
        # Paths no provider owns stream unless the body says otherwise.
        streamed = body.get("stream") is not False
    else:
        streamed = fmt.wants_stream(body, request.path)
    streamed = streamed or not fmt.replies_whole
    problem = _problem(fmt, controls, streamed, request)
    if problem is not None:
        response = _error_response(fmt, 400, f"streamwarden mock: {problem}")
        response.headers["x-mock-request-id"] = controls.request_id
        return response

    pieces = (
        tool_call_fragments(controls.tokens) if controls.tool_call else mock_tokens(controls.tokens)
    )
    broken = controls.fault is Fault.BROKEN_TOOL_CALL
    if broken:
        pieces = pieces[: _broken_after(controls)]
    answer = Answer(
        request_id=controls.request_id,
        model=fmt.model_for(body, request.path),
        pieces=tuple(pieces),
        prompt_tokens=max(1, len(raw) // 4),
        created=int(time.time()),
        tool_call=controls.tool_call,
        stream_arguments=_streams_arguments(body),
        broken_call=broken,
        include_usage=_include_usage(body),
        tokens_per_second=controls.tokens_per_second,
        ttft=controls.ttft,
    )
    record = state.stats.open(
        controls.request_id,
        request.path,
        dialect=fmt.dialect,
        wire=fmt.name,
        fault=None if controls.fault is None else controls.fault.value,
        streamed=streamed,
        tokens_planned=controls.tokens,
    )
    record.traceparent = request.headers.get("traceparent")
    with _watching(state, record):
        return await _answer(request, fmt, answer, controls, record, streamed)


async def _answer(
    request: web.Request,
    fmt: WireFormat,
    answer: Answer,
    controls: Controls,
    record: RequestRecord,
    streamed: bool,
) -> web.StreamResponse:
    fault = controls.fault
    if fault is not None and fault.delays_headers:
        await asyncio.sleep(DEFAULT_HEADER_DELAY if controls.delay is None else controls.delay)
    if fault is Fault.ERROR_STATUS:
        message = (
            f"streamwarden mock: simulated {controls.status} error (request {controls.request_id})"
        )
        body = fmt.error(controls.status, message) if controls.error_body else b""
        return await _send_whole(
            request, record, controls.status, fmt.error_content_type, body, tokens=0
        )
    if streamed:
        return await _play(request, fmt, answer, controls, record)
    # A whole reply costs the whole generation before its first byte.
    await asyncio.sleep(answer.generation_seconds())
    if fault is Fault.RESET:
        _reset_connection(request)
        return web.Response(status=502)  # never sent: the connection is gone
    reply = fmt.reply(answer)
    assert reply is not None  # streamed is forced for formats without whole replies
    return await _send_whole(
        request, record, 200, fmt.reply_content_type, reply, tokens=answer.completion_tokens
    )


async def _send_whole(
    request: web.Request,
    record: RequestRecord,
    status: int,
    content_type: str,
    body: bytes,
    *,
    tokens: int,
) -> web.StreamResponse:
    """Send a complete response with a ``Content-Length``; success completes a reply."""
    response = web.StreamResponse(
        status=status,
        headers={"Content-Type": content_type, "x-mock-request-id": record.request_id},
    )
    response.content_length = len(body)
    try:
        await response.prepare(request)
        record.status = status
        if body:
            await response.write(body)
        await response.write_eof()
    except ConnectionError:
        record.note_client_gone(time.monotonic())
        return response
    record.tokens_generated += tokens
    if record.engine is not None:
        record.engine.generated += tokens
    record.completed = status < 400
    return response


async def _play(
    request: web.Request,
    fmt: WireFormat,
    answer: Answer,
    controls: Controls,
    record: RequestRecord,
) -> web.StreamResponse:
    """Stream the answer with pacing, striking with the fault at its cut point."""
    fault = controls.fault
    response = web.StreamResponse(
        status=200, headers={**fmt.stream_headers(), "x-mock-request-id": controls.request_id}
    )
    writer = _Writer(response, record)
    ping = fmt.ping() if fault is Fault.KEEPALIVE_PINGS else None
    pacer = _Pacer(controls.ttft, controls.tokens_per_second, ping)
    try:
        await writer.start(request)
        pacer.restart()
        if fault is Fault.GARBAGE:
            await _play_garbage(writer, pacer, controls)
            return response

        frames = fmt.frames(answer)
        cut = len(frames)
        if fault is Fault.GIANT_EVENT:
            # The giant event replaces a token, so it must land on one.
            strike_at = min(controls.strike_after(), answer.completion_tokens - 1)
            cut = cut_index(frames, strike_at)
            token_index = sum(frame.tokens for frame in frames[:cut])
            frames[cut] = giant_frame(fmt, answer, token_index, controls.size)
        elif fault is not None and fault.cuts_stream:
            cut = cut_index(frames, controls.strike_after())

        strikes = fault is not None and fault.cuts_stream
        # Only SSE has comment lines: a line-based stream stays unstamped.
        stamped = controls.stamp and fmt.is_sse
        for index, frame in enumerate(frames):
            if (
                strikes
                and index == cut
                and not await _strike(request, writer, pacer, controls, frame)
            ):
                return response
            if frame.tokens:
                await pacer.next_token(writer)
            # The stamp is taken as the block goes to the socket, after the pacing wait.
            data = send_stamp(time.time()) + frame.data if stamped else frame.data
            await writer.write(data, frame.tokens)
        record.completed = True
        if strikes and cut == len(frames):
            # A format without a terminal event can still be cut after its last event.
            await _strike(request, writer, pacer, controls, None)
    except _ClientGone:
        pass
    return response


async def _strike(
    request: web.Request,
    writer: _Writer,
    pacer: _Pacer,
    controls: Controls,
    frame: Frame | None,
) -> bool:
    """Act out a cutting fault before ``frame``; return whether the stream goes on."""
    fault = controls.fault
    if fault is Fault.TRUNCATE_MID and frame is not None:
        await writer.write(frame.data[: len(frame.data) // 2])
    elif fault is Fault.STALL:
        if controls.delay is None:
            # Silent until the client leaves: handler cancellation ends this.
            await asyncio.Event().wait()
        await asyncio.sleep(controls.delay or 0.0)
        pacer.resume()
        return True
    elif fault is Fault.RESET:
        _reset_connection(request)
    elif fault is Fault.BROKEN_CHUNKED:
        transport = request.transport
        if transport is not None:
            # Behind aiohttp's back on purpose: its writer would frame this as a chunk.
            transport.write(_BROKEN_CHUNK)
            transport.close()
    return False


def _reset_connection(request: web.Request) -> None:
    """Abort the connection with a TCP RST: no chunked terminator, no FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger with a zero timeout turns close into a reset instead of a FIN.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def _play_garbage(writer: _Writer, pacer: _Pacer, controls: Controls) -> None:
    rng = random.Random(controls.request_id)
    for _ in range(controls.tokens):
        await pacer.next_token(writer)
        await writer.write(garbage_chunk(rng, _GARBAGE_CHUNK_BYTES))


def _request_id(request: web.Request) -> str:
    # Echo and WebSocket take no other control, and must not fail on a bad one.
    given = request.query.get("request-id") or request.headers.get("x-mock-request-id")
    if given and len(given) <= 200 and all(33 <= ord(c) <= 126 for c in given):
        return given
    return f"mock-{uuid.uuid4().hex[:16]}"


async def _handle_echo(request: web.Request) -> web.StreamResponse:
    """Describe the request exactly as received; the body is hashed as it streams in."""
    state = request.app[_STATE]
    record = state.stats.open(
        _request_id(request), request.path, dialect=None, wire="echo", fault=None, streamed=False
    )
    with _watching(state, record):
        digest = hashlib.sha256()
        size = 0
        try:
            async for chunk in request.content.iter_chunked(_SLICE):
                digest.update(chunk)
                size += len(chunk)
        except ConnectionError:
            record.note_client_gone(time.monotonic())
            return web.Response(status=400)  # never sent: the client is gone
        target = request.raw_path
        if target.startswith("/"):
            path, _, query_string = target.partition("?")
        else:  # absolute-form request target
            path, query_string = request.rel_url.raw_path, request.rel_url.raw_query_string
        description = {
            "method": request.method,
            "path": path,
            "query_string": query_string,
            "version": f"{request.version.major}.{request.version.minor}",
            "headers": [
                [name.decode("latin-1"), value.decode("latin-1")]
                for name, value in request.raw_headers
            ],
            "body_bytes": size,
            "body_sha256": digest.hexdigest(),
        }
        body = json.dumps(description, ensure_ascii=False).encode()
        return await _send_whole(request, record, 200, "application/json", body, tokens=0)


def _requested_close_code(text: str) -> int | None:
    if not text.startswith("close:"):
        return None
    try:
        code = int(text.removeprefix("close:").strip())
    except ValueError:
        return None
    if 1000 <= code <= 4999 and code not in _RESERVED_CLOSE_CODES:
        return code
    return None


async def _handle_websocket(request: web.Request) -> web.StreamResponse:
    """Echo text and binary messages; ``close:<code>`` closes with that code."""
    state = request.app[_STATE]
    request_id = _request_id(request)
    ws = web.WebSocketResponse()
    ws.headers["x-mock-request-id"] = request_id
    record = state.stats.open(
        request_id, request.path, dialect=None, wire="websocket", fault=None, streamed=True
    )
    with _watching(state, record):
        await ws.prepare(request)
        record.status = 101
        closed_with: int | None = None
        try:
            async for message in ws:
                if message.type is WSMsgType.TEXT:
                    code = _requested_close_code(message.data)
                    if code is not None:
                        closed_with = code
                        await ws.close(code=code, message=b"closed on request")
                        break
                    await ws.send_str(message.data)
                elif message.type is WSMsgType.BINARY:
                    await ws.send_bytes(message.data)
        except ConnectionError:
            pass
        # After a close the mock started, ws.close_code is the peer's reply code;
        # the record keeps the code the mock sent.
        record.close_code = closed_with if closed_with is not None else ws.close_code
        record.completed = record.close_code not in (None, WSCloseCode.ABNORMAL_CLOSURE)
        if not record.completed:
            record.note_client_gone(time.monotonic())
    return ws


async def _handle_responses_websocket(
    request: web.Request, fmt: WireFormat, controls: Controls
) -> web.StreamResponse:
    """The Responses API over a WebSocket (``GET /v1/responses``, upgraded).

    Each ``response.create`` text message is answered with the events of
    the SSE version, one text message each (their data), with the
    ``stream_id`` it named echoed. The handshake's controls steer every
    answer of the session, and a fault strikes at each answer's cut:
    ``truncate`` (and ``truncate-mid``) closes with 1000, ``reset`` vanishes
    without a close frame (the client sees 1006), ``stall`` goes silent until
    the client leaves, ``giant-event`` makes the token message at the cut
    ``size`` bytes. Other messages get no answer.
    """
    state = request.app[_STATE]
    ws = web.WebSocketResponse(max_msg_size=_BODY_LIMIT)
    ws.headers["x-mock-request-id"] = controls.request_id
    fault = controls.fault
    record = state.stats.open(
        controls.request_id,
        request.path,
        dialect=fmt.dialect,
        wire="websocket",
        fault=None if fault is None else fault.value,
        streamed=True,
    )
    with _watching(state, record):
        await ws.prepare(request)
        record.status = 101
        try:
            async for message in ws:
                if message.type is not WSMsgType.TEXT:
                    continue
                body = _json_object(message.data.encode())
                if body.get("type") != "response.create":
                    continue
                if not await _answer_over_websocket(request, ws, fmt, controls, record, body):
                    break
        except ConnectionError:
            pass
        if record.close_code is None:
            record.close_code = ws.close_code
        if record.close_code in (None, WSCloseCode.ABNORMAL_CLOSURE):
            record.note_client_gone(time.monotonic())
    return ws


async def _answer_over_websocket(
    request: web.Request,
    ws: web.WebSocketResponse,
    fmt: WireFormat,
    controls: Controls,
    record: RequestRecord,
    body: dict[str, Any],
) -> bool:
    """Play one answer as messages; whether the session goes on (no fault ended it)."""
    answer = Answer(
        request_id=controls.request_id,
        model=fmt.model_for(body, request.path),
        pieces=tuple(
            tool_call_fragments(controls.tokens)
            if controls.tool_call
            else mock_tokens(controls.tokens)
        ),
        prompt_tokens=max(1, len(json.dumps(body)) // 4),
        created=int(time.time()),
        tool_call=controls.tool_call,
    )
    record.tokens_planned += controls.tokens
    frames = [
        *fmt.preamble(answer),
        *(fmt.token(answer, i, piece) for i, piece in enumerate(answer.pieces)),
        *fmt.closing(answer),
    ]
    fault = controls.fault
    after = controls.fault_after if controls.fault_after is not None else controls.tokens // 2
    cut = cut_index(frames, after) if fault is not None else len(frames) + 1
    lane = body.get("stream_id")
    gap = 1.0 / controls.tokens_per_second if controls.tokens_per_second else 0.0
    tokens = 0
    for index, frame in enumerate(frames):
        if index == cut:
            if fault in (Fault.TRUNCATE, Fault.TRUNCATE_MID):
                record.close_code = WSCloseCode.OK
                await ws.close(code=WSCloseCode.OK, message=b"done")
                return False
            if fault is Fault.RESET:
                record.close_code = WSCloseCode.ABNORMAL_CLOSURE
                _reset_connection(request)
                return False
            if fault is Fault.STALL:
                await asyncio.Event().wait()  # until the client leaves
            if fault is Fault.GIANT_EVENT and frame.tokens:
                frame = giant_frame(fmt, answer, tokens, controls.size)
        if frame.tokens:
            await asyncio.sleep(controls.ttft if tokens == 0 else gap)
            tokens += frame.tokens
        await ws.send_str(_message_of(frame.data, lane))
        record.tokens_generated += frame.tokens
    record.completed = True
    return True


def _message_of(block: bytes, lane: object) -> str:
    """An SSE event's data, as the WebSocket message that carries it (with its lane)."""
    data = next(
        line.removeprefix(b"data: ") for line in block.splitlines() if line.startswith(b"data: ")
    ).decode()
    if isinstance(lane, str):
        payload = json.loads(data)
        payload["stream_id"] = lane
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return data


async def _handle_stats(request: web.Request) -> web.Response:
    """``GET /_mock/stats[?request_id=ID]``: the records as JSON."""
    stats = request.app[_STATE].stats
    wanted = request.query.get("request_id")
    records = [
        record.to_dict()
        for record in stats.records
        if wanted is None or record.request_id == wanted
    ]
    return web.json_response({"records": records})


async def _handle_reset(request: web.Request) -> web.Response:
    """``POST /_mock/reset``: forget every record."""
    request.app[_STATE].stats.reset()
    return web.json_response({"records": []})
