"""Tool calls cut or closed broken, through the real sidecar and the real middleware.

The mock upstream streams one tool call in every dialect, cut inside its
arguments (``truncate`` after 3 of 8 fragments; ``truncate-mid`` inside a
Gemini call's one event) or closed after 3 fragments (``broken-tool-call``).
Read directly with httpx, the partial arguments pass silently: the stream
just ends (or even ends whole). Through the sidecar, and through the
middleware in front of an app that relays the same upstream under uvicorn,
the client reads the same events and then the dialect's error event:
``tool_call_truncated`` or ``tool_call_invalid``, naming the call. Both
faces count the calls and name them in the stream's record and its span.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from middleware_apps import relaying, serve_in_process
from sidecars import StartSidecar
from streamwarden.core.meter import EndState
from streamwarden.core.toolcalls import is_arguments
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import MockServer
from streamwarden.tools.mock.tokens import mock_text, tool_call_fragments
from tool_streams import STREAMS, ToolStream, arguments_in, error_of, names_the_call
from upstreams import ServeUpstream
from waiting import wait_for

TOKENS = 8
KEPT = 3
FAULTS = ("cut", "broken")


def query(stream: ToolStream, fault: str) -> str:
    kind = "broken-tool-call" if fault == "broken" else "truncate"
    if fault == "cut" and stream.whole:
        kind = "truncate-mid"  # the call is one event: cut inside it
    joined = "&" if "?" in stream.mock_path else "?"
    controls = f"tool-call=1&tokens={TOKENS}&tps=0&ttft=0&fault={kind}&fault-after={KEPT}"
    return f"{stream.mock_path}{joined}{controls}&request-id={request_id(stream, fault)}"


def request_id(stream: ToolStream, fault: str) -> str:
    return f"{stream.name}-{fault}"


async def read(base: str, stream: ToolStream, fault: str, *, through: bool = False) -> bytes:
    """The body; through streamwarden, a dialect whose clients raise on no error event
    (Cohere's) has its body broken after the error event, the others' end cleanly."""
    got: list[bytes] = []
    broken = False
    async with (
        httpx.AsyncClient(timeout=10) as client,
        client.stream("POST", base + query(stream, fault), json=stream.request_body()) as response,
    ):
        assert response.status_code == 200
        try:
            async for chunk in response.aiter_bytes():
                got.append(chunk)
        except httpx.RemoteProtocolError:
            broken = True
    assert broken == (through and not stream.relay().rules.error_event_raises), stream.name
    return b"".join(got)


def partial_arguments(stream: ToolStream) -> str:
    """What a client holds of the call's arguments after the first KEPT fragments."""
    if stream.stream_arguments:
        return mock_text(KEPT)
    return "".join(tool_call_fragments(TOKENS)[:KEPT])


async def the_failure_directly_and_its_error_through(
    direct_base: str, guarded_base: str, stream: ToolStream, fault: str
) -> None:
    direct = stream.decode(await read(direct_base, stream, fault))
    through = stream.decode(await read(guarded_base, stream, fault, through=True))
    # Directly: no error; the client holds arguments that are not whole (or none of them).
    assert all(b"tool_call_" not in e.data.encode() for e in direct)
    held = arguments_in(stream, direct)
    if stream.whole and fault == "cut":
        assert held == ""  # the one event that carried the call never came whole
    else:
        assert held == partial_arguments(stream)
        assert stream.stream_arguments or not is_arguments(held)
    # Through streamwarden: the same events, then the error in place of what follows.
    code, message = error_of(stream, through[-1])
    assert code == ("tool_call_invalid" if fault == "broken" else "tool_call_truncated")
    assert names_the_call(stream, message, request_id(stream, fault)), message
    # (A broken Gemini call is one event, the one replaced: the client never sees it.)
    assert arguments_in(stream, through[:-1]) == ("" if stream.whole else held)
    if fault == "cut":
        assert len(through) == len(direct) + 1
    else:  # the call's close and what follows it never reach the client
        # (A broken stream of Gemini partialArgs is closed by its finishReason, the last event.)
        closes = (i for i, e in enumerate(direct) if stream.closes(e.data.encode()))
        assert len(through) == next(closes, len(direct) - 1) + 1


def counted(page: str) -> dict[tuple[str, str], float]:
    found: dict[tuple[str, str], float] = {}
    for line in page.splitlines():
        if line.startswith("streamwarden_tool_calls_total{"):
            labels, value = line.split("} ")
            pairs = dict(p.split("=") for p in labels.split("{", 1)[1].split(","))
            found[(pairs["dialect"].strip('"'), pairs["end_state"].strip('"'))] = float(value)
    return found


EXPECTED_COUNTS = {
    ("openai-chat", "truncated"): 1.0,
    ("openai-chat", "invalid"): 1.0,
    ("openai-responses", "truncated"): 1.0,
    ("openai-responses", "invalid"): 1.0,
    ("anthropic", "truncated"): 1.0,
    ("anthropic", "invalid"): 1.0,
    ("gemini", "truncated"): 2.0,
    ("gemini", "invalid"): 2.0,
    ("cohere", "truncated"): 1.0,
    ("cohere", "invalid"): 1.0,
    ("vercel-ai", "truncated"): 2.0,
    ("vercel-ai", "invalid"): 2.0,
}


async def test_the_sidecar_names_a_cut_or_broken_call_in_every_dialect(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    for stream in STREAMS:
        for fault in FAULTS:
            await the_failure_directly_and_its_error_through(
                mock.url, sidecar.proxy_url, stream, fault
            )
    await wait_for(lambda: len(sidecar.tracker.finished) == len(STREAMS) * len(FAULTS))
    assert counted(sidecar.metrics.render().decode()) == EXPECTED_COUNTS
    states = {s.meter.end_state for s in sidecar.tracker.finished}
    assert states == {EndState.UPSTREAM_TRUNCATED, EndState.UPSTREAM_ERROR}
    for record in sidecar.tracker.finished:
        (call,) = record.meter.as_record()["tool_calls"]
        assert call["name"] == "lookup" and call["end_state"] in ("truncated", "invalid")


# -- the middleware -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def guarded_app(upstream: str) -> AsyncIterator[tuple[str, StreamWardenMiddleware]]:
    guarded = StreamWardenMiddleware(relaying(upstream), keepalive_interval=0)
    async with serve_in_process(guarded) as base:
        yield base, guarded


async def test_the_middleware_names_a_cut_or_broken_call_in_every_dialect(
    mock: MockServer,
) -> None:
    async with (
        serve_in_process(relaying(mock.url)) as plain,
        guarded_app(mock.url) as (
            base,
            guarded,
        ),
    ):
        for stream in STREAMS:
            for fault in FAULTS:
                await the_failure_directly_and_its_error_through(plain, base, stream, fault)
        await wait_for(lambda: len(guarded.streams.finished) == len(STREAMS) * len(FAULTS))
        assert counted(guarded.metrics.render().decode()) == EXPECTED_COUNTS


async def test_both_faces_hold_no_more_arguments_than_max_tool_arguments_bytes(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    stream = STREAMS[0]
    path = f"{stream.mock_path}?tool-call=1&tokens=200&tps=0&ttft=0"
    sidecar = await start_sidecar(mock.url, max_tool_arguments_bytes="1KiB")
    guarded = StreamWardenMiddleware(relaying(mock.url), max_tool_arguments_bytes=1024)
    async with serve_in_process(guarded) as base, httpx.AsyncClient(timeout=10) as client:
        whole = await client.post(mock.url + path, json=stream.request_body())
        assert is_arguments(arguments_in(stream, stream.decode(whole.content)))
        for face in (sidecar.proxy_url, base):
            answer = await client.post(face + path, json=stream.request_body())
            events = stream.decode(answer.content)
            code, message = error_of(stream, events[-1])
            assert code == "tool_call_too_large" and "1024 bytes" in message, message
            assert len(arguments_in(stream, events)) <= 1024
        await wait_for(lambda: len(guarded.streams.finished) == 1)
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    for record in (sidecar.tracker.finished[0], guarded.streams.finished[0]):
        assert record.meter.end_state is EndState.LIMIT_EXCEEDED


# -- the span ---------------------------------------------------------------------------


class Spans:
    """An OTLP/HTTP receiver of spans, decoded with opentelemetry-proto."""

    def __init__(self) -> None:
        self.received: list[Any] = []

    async def traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                self.received.extend(scope.spans)
        return web.Response(content_type="application/x-protobuf", body=b"")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(content_type="application/x-protobuf", body=b"")


@pytest.fixture
async def spans(monkeypatch: pytest.MonkeyPatch, serve_upstream: ServeUpstream) -> Spans:
    """The receiver; asked for before the sidecar, it outlives the sidecar's last flush."""
    pytest.importorskip("opentelemetry.sdk")
    received = Spans()
    app = web.Application()
    app.router.add_post("/v1/traces", received.traces)
    app.router.add_post("/v1/metrics", received.metrics)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", await serve_upstream(app))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    return received


async def test_the_span_names_the_cut_call(
    spans: Spans, mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, otel_exporter="otlp-http")
    stream = STREAMS[0]
    await read(sidecar.proxy_url, stream, "cut")
    await wait_for(lambda: any(s.kind == 2 for s in spans.received), what="a server span")
    (server,) = [s for s in spans.received if s.kind == 2]  # SPAN_KIND_SERVER
    seen = {kv.key: kv.value for kv in server.attributes}
    assert seen["streamwarden.error_code"].string_value == "tool_call_truncated"

    def strings(key: str) -> list[str]:
        return [v.string_value for v in seen[key].array_value.values]

    assert strings("streamwarden.tool_calls.ids") == [stream.call_id(request_id(stream, "cut"))]
    assert strings("streamwarden.tool_calls.names") == ["lookup"]
    assert strings("streamwarden.tool_calls.end_states") == ["truncated"]
