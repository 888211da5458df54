"""One end for both faces: a stream ends the same through the sidecar and through the middleware.

The same Starlette app is the sidecar's upstream (served plainly) and the
app behind ``StreamWardenMiddleware``, so both faces see the same bytes.
Each way a stream can end is then run through both, and what the end
writes is compared: the stream's log line (every field; the timings by
whether they were measured), the Prometheus counts, the detached-streams
gauge, what a resume gets from the sealed journal once the stream is
over, and the OpenTelemetry server span. A rule that differed between the
faces' ends shows here as a field that differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from middleware_apps import serve_in_process
from resume_client import KEY, read_events
from sidecars import StartSidecar
from streamwarden.config import load_settings
from streamwarden.core.plan import StreamPlan
from streamwarden.core.sse import Event, SSEDecoder
from streamwarden.features.resume.model import STREAM_ID_HEADER, Journal
from streamwarden.features.resume.service import ResumeService
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.observation.logs import STREAM_LOGGER
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.observation.register import StreamRegister
from streamwarden.pipeline import FaceServices, Pipeline, StreamStart
from streamwarden.pipeline.stamping import JournalStamps
from waiting import wait_for

CHAT = "/v1/chat/completions"
#: Fields measured in time: equal between the faces only in being measured or not.
TIMINGS = frozenset(
    {
        "ttft_s",
        "duration_s",
        "inter_token_gap_max_s",
        "inter_token_gap_mean_s",
        "cancel_propagation_s",
    }
)
#: Fields that count what crossed before the client left: they depend on when.
COUNTS = frozenset(
    {
        "events_in",
        "events_out",
        "bytes_in",
        "bytes_out",
        "content_events_in",
        "content_events_out",
        "tokens_generated",
        "tokens_delivered",
        "tokens_zombie",
    }
)


async def chat(request: Request) -> StreamingResponse:
    """OpenAI chat chunks: ``x-test-tokens`` of them, ``x-test-pace`` apart, then [DONE] or not."""
    tokens = int(request.headers.get("x-test-tokens", "8"))
    pace = float(request.headers.get("x-test-pace", "0"))
    whole = request.headers.get("x-test-end", "done") == "done"

    async def body() -> AsyncIterator[bytes]:
        for n in range(tokens):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{n} "}}]}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await asyncio.sleep(pace)
        if whole:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def model() -> Starlette:
    return Starlette(routes=[Route(CHAT, chat, methods=["POST"])])


@dataclass
class Ending:
    """One way for a stream to end: what the request asks, what the client does, the options."""

    #: The end state it has, in both faces.
    end_state: str
    headers: dict[str, str]
    #: Events the client reads before it leaves; None: it reads to the end.
    leaves_after: int | None = None
    options: dict[str, Any] | None = None


ENDINGS = [
    Ending("completed", {}),
    Ending("upstream_truncated", {"x-test-end": "cut"}),
    Ending("client_cancelled", {"x-test-tokens": "200", "x-test-pace": "0.02"}, leaves_after=3),
    Ending(
        "detached_expired",
        {"x-test-tokens": "200", "x-test-pace": "0.02"},
        leaves_after=3,
        options={"on_client_gone": "detach", "resume_window": "400ms"},
    ),
]


@dataclass
class Seen:
    """What one face's end wrote for one stream."""

    line: dict[str, Any]
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    #: The detached-streams gauge once the stream was over.
    detached: float
    #: The last event a resume from the last one read got, once the stream was over.
    resumed: Event | None


async def through(
    url: str,
    ending: Ending,
    register: StreamRegister[Any],
    metrics: StreamMetrics,
    caplog: pytest.LogCaptureFixture,
    *,
    resume: bool = True,
) -> Seen:
    caplog.set_level(logging.INFO, logger=STREAM_LOGGER)
    caplog.clear()
    headers = {**KEY, **ending.headers}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=headers, json={"stream": True}) as response:
            stream_id = response.headers.get(STREAM_ID_HEADER)
            count = ending.leaves_after
            events = await read_events(
                response, until=None if count is None else lambda got: len(got) >= count
            )
            response.close()
        if stream_id is not None:
            # A detached stream is counted while its client is gone.
            await wait_for(lambda: _gauge(metrics) == 1, what="the stream counted as detached")
        await wait_for(lambda: len(register.finished) == 1, what="the stream recorded")
        resumed = None
        if stream_id is not None and resume:
            again = {**KEY, "Last-Event-ID": events[-1].id or ""}
            async with session.post(url + CHAT, headers=again, json={"stream": True}) as reply:
                decoder = SSEDecoder()
                resumed = (decoder.feed(await reply.read()) + decoder.close())[-1]
    (line,) = [r.fields for r in caplog.records if r.name == STREAM_LOGGER]  # type: ignore[attr-defined]
    return Seen(line, _counts(metrics), _gauge(metrics), resumed)


def _gauge(metrics: StreamMetrics) -> float:
    value = metrics.registry.get_sample_value("streamwarden_detached_streams")
    return 0.0 if value is None else value


def _counts(metrics: StreamMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The end's counters: streams by end state, error events by code, cancels measured."""
    kept = (
        "streamwarden_streams_total",
        "streamwarden_synthesized_errors_total",
        "streamwarden_cancel_propagation_seconds_count",
    )
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name in kept
    }


def comparable(line: dict[str, Any], *, whole: bool) -> dict[str, Any]:
    """The line's fields; timings by whether measured; counts only for a stream read whole."""
    out = {}
    for name, value in line.items():
        if name in TIMINGS:
            out[name] = value is not None
        elif name not in COUNTS or whole:
            out[name] = value
    return out


@contextlib.asynccontextmanager
async def middleware_face(**options: Any) -> AsyncIterator[tuple[str, StreamWardenMiddleware]]:
    guarded = StreamWardenMiddleware(model(), **options)
    async with serve_in_process(guarded) as url:
        yield url, guarded


@pytest.mark.parametrize("ending", ENDINGS, ids=[e.end_state for e in ENDINGS])
async def test_a_stream_ends_the_same_through_both_faces(
    ending: Ending, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    options = ending.options or {}
    async with serve_in_process(model()) as upstream:
        sidecar = await start_sidecar(upstream, usage_injection="off", **options)
        by_sidecar = await through(
            sidecar.proxy_url, ending, sidecar.tracker, sidecar.metrics, caplog
        )
    async with middleware_face(**options) as (url, guarded):
        by_middleware = await through(url, ending, guarded.streams, guarded.metrics, caplog)

    assert by_sidecar.line["end_state"] == ending.end_state
    whole = ending.leaves_after is None
    assert comparable(by_middleware.line, whole=whole) == comparable(by_sidecar.line, whole=whole)
    assert by_middleware.metrics == by_sidecar.metrics
    assert by_middleware.detached == by_sidecar.detached
    if ending.end_state == "detached_expired":
        # Given back at the end; and a resume after the end is told how the
        # stream ended, by its seal.
        assert by_sidecar.detached == 0
        assert by_sidecar.resumed is not None and by_middleware.resumed is not None
        assert json.loads(by_sidecar.resumed.data)["error"]["code"] == "resume_expired"
        assert by_middleware.resumed.data == by_sidecar.resumed.data
    else:
        assert by_sidecar.resumed is None and by_middleware.resumed is None


async def server_span(receiver: Any) -> dict[str, Any]:
    """The one server span exported since the last call: its attributes, status and events."""
    from otlp_receiver import attributes, servers

    await wait_for(lambda: len(servers(receiver)) == 1, what="the server span exported")
    (span,) = servers(receiver)
    receiver.spans.clear()
    seen = attributes(span)
    seen["status"] = span.status.code
    seen["events"] = [event.name for event in span.events]
    return seen


#: Span attributes measured in time, or counted before the client left.
SPAN_TIMINGS = frozenset(
    {"gen_ai.response.time_to_first_chunk", "streamwarden.cancel_propagation_s"}
)
SPAN_COUNTS = frozenset(
    {"gen_ai.usage.output_tokens", "streamwarden.tokens.delivered", "streamwarden.tokens.zombie"}
)


@pytest.mark.parametrize("ending", ENDINGS, ids=[e.end_state for e in ENDINGS])
async def test_a_streams_spans_end_the_same_through_both_faces(
    ending: Ending,
    receiver: Any,
    start_sidecar: StartSidecar,
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = {**(ending.options or {}), "otel_exporter": "otlp-http"}
    async with serve_in_process(model()) as upstream:
        sidecar = await start_sidecar(upstream, usage_injection="off", **options)
        # No resume afterwards: its request would be a span of its own.
        await through(
            sidecar.proxy_url, ending, sidecar.tracker, sidecar.metrics, caplog, resume=False
        )
        by_sidecar = await server_span(receiver)
    async with middleware_face(**options) as (url, guarded):
        await through(url, ending, guarded.streams, guarded.metrics, caplog, resume=False)
        by_middleware = await server_span(receiver)
    # Awaited (it was once called in a thread and never ran): its exporters'
    # last export goes to the receiver in this loop from a thread of its own.
    await guarded.close()

    assert by_sidecar["streamwarden.end_state"] == ending.end_state
    whole = ending.leaves_after is None
    for seen in (by_sidecar, by_middleware):
        for name in SPAN_TIMINGS | (frozenset() if whole else SPAN_COUNTS):
            if name in seen:
                seen[name] = True
    assert by_middleware == by_sidecar


class BrokenStore:
    """A store entry whose every write fails, as a store's code might."""

    def append(self, seq: int, data: bytes) -> None:
        raise OSError("the store is broken")

    def end(self, state: str, dialect: str) -> None:
        raise OSError("the store is broken")


def test_a_journal_that_fails_at_the_end_still_leaves_the_register_and_the_gauge() -> None:
    settings = load_settings(environ={}, overrides={"on_client_gone": "detach"})
    route = settings.for_path(CHAT)
    metrics = StreamMetrics()
    register: StreamRegister[str] = StreamRegister()
    services = FaceServices("middleware", settings, metrics, ResumeService(settings, metrics))
    pipeline = Pipeline(services, register)
    plan = StreamPlan("sse", "identity", "text/event-stream")
    flow = pipeline.open(
        StreamStart("middleware", route, plan, "POST", CHAT, 200, (), {}, 0.0, 0.0)
    )
    relay = flow.relay
    stamps = flow.transform_of(JournalStamps)
    assert stamps is not None  # the resume stage ran
    stamps.journal = Journal("a" * 32, BrokenStore())
    register.open("the stream")
    relay.client_gone(1.0)  # the route detaches: the stream runs on for a resume
    flow.counted_detached = pipeline.end.count_detached(relay)
    assert flow.counted_detached and _gauge(metrics) == 1

    with pytest.raises(OSError, match="the store is broken"):
        pipeline.finish("the stream", flow, 3.0)
    # The stream left the register (a drain waiting for it ends), with its
    # record, and the gauge no longer counts it.
    assert not register.active
    (record,) = register.finished
    assert record.meter.end_state == "client_cancelled"
    assert _gauge(metrics) == 0
