"""One pipeline for both faces: a stage added in one place acts in the sidecar and the app."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from locations import REPO
from middleware_apps import serve_in_process
from shout_stage import Shout
from sidecars import StartSidecar
from streamwarden import pipeline
from streamwarden.core.meter import StreamRecord
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.observation.register import StreamRegister
from streamwarden.observation.telemetry import Telemetry
from streamwarden.pipeline import STAGES, PipelineStream, Stage, StreamStart
from streamwarden.pipeline.parity import parity_table
from streamwarden.pipeline.resume import ResumeJournal
from streamwarden.sse import SSEDecoder
from streamwarden.tools.mock import MockServer
from waiting import wait_for

PARITY_PAGE = REPO / "docs" / "reference" / "parity.md"
CHAT = "/v1/chat/completions"
EVENTS = [b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"]

#: What the toy stage saw end, by face.
ENDED: list[tuple[str, str]] = []


class Stamp(Stage):
    """A toy stage: a header on the stream's head, and a note of its end."""

    __slots__ = ()

    name = "stamp"
    summary = "a header naming the face"

    def wanted(self, start: StreamStart) -> bool:
        return start.path.endswith("/completions")

    def opened(self, stream: PipelineStream) -> None:
        stream.headers.append(("x-stamp", stream.start.face))

    def closed(self, stream: PipelineStream, record: StreamRecord) -> None:
        ENDED.append((stream.start.face, str(record.meter.end_state)))


@pytest.fixture
def stamped(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    # The one place: the plan.
    monkeypatch.setattr(pipeline, "STAGES", [*STAGES, Stamp])
    ENDED.clear()
    yield None


async def _app_stream(request: Request) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for event in EVENTS:
            yield event

    return StreamingResponse(events(), media_type="text/event-stream")


async def test_a_stage_added_to_the_plan_acts_in_both_faces(
    stamped: None, mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    app = Starlette(routes=[Route(CHAT, _app_stream, methods=["POST"])])
    app.add_middleware(StreamWardenMiddleware)
    async with serve_in_process(app) as url, httpx.AsyncClient() as client:
        body = {"stream": True, "messages": []}
        through_sidecar = await client.post(sidecar.proxy_url + CHAT, json=body)
        through_middleware = await client.post(url + CHAT, json=body)
        await wait_for(lambda: len(ENDED) == 2, what="both streams ended")
    assert through_sidecar.headers["x-stamp"] == "sidecar"
    assert through_middleware.headers["x-stamp"] == "middleware"
    assert sorted(ENDED) == [("middleware", "completed"), ("sidecar", "completed")]
    # And the parity table lists it, as it lists every stage of the plan.
    assert "| `stamp` | a header naming the face | yes | yes |" in parity_table()


async def test_a_stage_left_out_of_the_plan_acts_in_neither(
    monkeypatch: pytest.MonkeyPatch, start_sidecar: StartSidecar, mock: MockServer
) -> None:
    monkeypatch.setattr(pipeline, "STAGES", [s for s in STAGES if s.name != "resume"])
    sidecar = await start_sidecar(mock.url, on_client_gone="detach")
    app = Starlette(routes=[Route(CHAT, _app_stream, methods=["POST"])])
    app.add_middleware(StreamWardenMiddleware, on_client_gone="detach")
    async with serve_in_process(app) as url, httpx.AsyncClient() as client:
        for base in (sidecar.proxy_url, url):
            answer = await client.post(base + CHAT, json={"stream": True})
            assert "streamwarden-stream-id" not in answer.headers
            assert b"\nid: " not in answer.content and not answer.content.startswith(b"id:")


@pytest.mark.parametrize("planned", [True, False], ids=["resume planned", "resume left out"])
async def test_a_resume_is_answered_by_both_faces_only_while_its_stage_is_planned(
    planned: bool, monkeypatch: pytest.MonkeyPatch, start_sidecar: StartSidecar
) -> None:
    """The plan's line is what answers a resume, in the sidecar and in the middleware alike."""
    if not planned:
        monkeypatch.setattr(pipeline, "STAGES", [s for s in STAGES if s is not ResumeJournal])
    #: The Last-Event-ID of every request that reached the upstream or the app.
    reached: list[str | None] = []

    async def chat(request: Request) -> StreamingResponse:
        reached.append(request.headers.get("last-event-id"))
        return await _app_stream(request)

    upstream = Starlette(routes=[Route(CHAT, chat, methods=["POST"])])
    app = Starlette(routes=[Route(CHAT, chat, methods=["POST"])])
    app.add_middleware(StreamWardenMiddleware, on_client_gone="detach")
    async with (
        serve_in_process(upstream) as upstream_url,
        serve_in_process(app) as url,
        httpx.AsyncClient() as client,
    ):
        sidecar = await start_sidecar(upstream_url, on_client_gone="detach")
        for base in (sidecar.proxy_url, url):
            # A position we never wrote: a resume all the same, never to be forwarded.
            resumed = await client.post(
                base + CHAT, json={"stream": True}, headers={"Last-Event-ID": "42"}
            )
            assert resumed.status_code == 200
            if planned:
                assert b"resume_expired" in resumed.content
            else:
                assert resumed.content == b"".join(EVENTS)
    assert reached == ([] if planned else ["42", "42"])


class Model:
    """The model's side, the same for both faces: the sidecar's upstream and the middleware's app.

    Two text events (one gap between them, a secret in the first), a
    ``silence`` between them (the model thinking), and the end.
    """

    def __init__(self, silence: float) -> None:
        self.silence = silence
        #: The body of every request that reached it.
        self.bodies: list[dict[str, Any]] = []
        self.app = Starlette(routes=[Route(CHAT, self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> StreamingResponse:
        self.bodies.append(await request.json())

        async def events() -> AsyncIterator[bytes]:
            yield _chunk("the password is hunter2")
            if self.silence:
                await asyncio.sleep(self.silence)  # the upstream's silence is the scenario
            yield _chunk(", bye")
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _chunk(text: str) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(delta).encode() + b"\n\n"


@dataclass
class Seen:
    """What one face did with its streams: what its client read, and what it recorded."""

    bodies: list[bytes]
    #: The requests that reached the model (the sidecar's upstream, the middleware's app).
    reached: list[dict[str, Any]]
    metrics: StreamMetrics
    #: Server spans exported by the face (its exporter flushed after the streams).
    spans: int


@dataclass(frozen=True)
class Capability:
    """One stage's capability: the settings that ask for it, and how a face shows it."""

    settings: dict[str, Any]
    shows: Callable[[Seen], bool]
    silence: float = 0.0
    #: Usage injection changes a kind of request only after one unchanged stream taught it.
    requests: int = 1


def _id_lines(body: bytes) -> bool:
    return re.search(rb"(^|\n)id: ", body) is not None


#: Every stage of the plan, by name: what removing its line must take from both faces.
CAPABILITIES = {
    "keep-alive": Capability(
        {"keepalive_interval": "20ms"},
        lambda seen: all(b": keep-alive\n\n" in body for body in seen.bodies),
        silence=0.25,
    ),
    "limits": Capability(
        {"upstream_idle_timeout": "50ms"},
        lambda seen: all(b"upstream_timeout" in body for body in seen.bodies),
        silence=0.25,
    ),
    "metering": Capability({}, lambda seen: sum(seen.metrics.inter_token.counts.counts) > 0),
    "usage": Capability(
        {"usage_injection": "auto"},
        lambda seen: any("stream_options" in sent for sent in seen.reached),
        requests=2,
    ),
    "filters": Capability(
        {"output_filters": [{"literal": "hunter2", "action": "redact"}]},
        lambda seen: all(b"hunter2" not in body for body in seen.bodies),
    ),
    "resume": Capability(
        {"on_client_gone": "detach"}, lambda seen: all(_id_lines(body) for body in seen.bodies)
    ),
    "telemetry": Capability({"otel_exporter": "otlp-http"}, lambda seen: seen.spans > 0),
}

ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
#: A tenant's key: usage injection never changes a request without credentials.
TENANT = {"Authorization": "Bearer tenant-a"}


async def _through(
    url: str,
    register: StreamRegister[Any],
    metrics: StreamMetrics,
    telemetry: Telemetry | None,
    capability: Capability,
    model: Model,
    receiver: Any,
) -> Seen:
    """``capability.requests`` streams through one face, and what it did with them."""
    from otlp_receiver import servers

    model.bodies.clear()
    receiver.spans.clear()
    bodies = []
    async with httpx.AsyncClient() as client:
        for _ in range(capability.requests):
            answer = await client.post(url + CHAT, json=ASK, headers=TENANT)
            assert answer.status_code == 200
            bodies.append(answer.content)
            # Ended (and learned from) before the next one goes.
            await wait_for(lambda: len(register.finished) == len(bodies), what="the stream ended")
    if telemetry is not None:  # whatever was to be exported, exported
        await telemetry.shutdown_within(10)
    return Seen(bodies, list(model.bodies), metrics, len(servers(receiver)))


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "removed"])
@pytest.mark.parametrize("stage", STAGES, ids=[stage.name for stage in STAGES])
async def test_removing_a_stages_line_from_the_plan_takes_its_capability_from_both_faces(
    stage: type[Stage],
    planned: bool,
    monkeypatch: pytest.MonkeyPatch,
    start_sidecar: StartSidecar,
    receiver: Any,
) -> None:
    """Each stage's line is what gives a stream its capability, in the sidecar and the app.

    Planned, each face shows it as the parity table says (the middleware
    has usage injection's gap); its line removed, neither does.
    """
    capability = CAPABILITIES[stage.name]  # a stage added to the plan needs its case here
    if not planned:
        monkeypatch.setattr(pipeline, "STAGES", [s for s in STAGES if s is not stage])
    model = Model(capability.silence)
    async with serve_in_process(model.app) as upstream:
        sidecar = await start_sidecar(upstream, **capability.settings)
        services = sidecar.services
        by_sidecar = await _through(
            sidecar.proxy_url,
            sidecar.tracker,
            services.metrics,
            services.telemetry,
            capability,
            model,
            receiver,
        )
    guarded = StreamWardenMiddleware(model.app, **capability.settings)
    async with serve_in_process(guarded) as url:
        by_middleware = await _through(
            url, guarded.streams, guarded.metrics, guarded.telemetry, capability, model, receiver
        )
    assert capability.shows(by_sidecar) is planned
    assert capability.shows(by_middleware) is (planned and not stage.middleware_gap)


def _answer(stream: bytes) -> str:
    """The text an OpenAI client reads from a Chat Completions stream."""
    events = SSEDecoder().feed(stream)
    return "".join(
        json.loads(e.data)["choices"][0]["delta"].get("content") or ""
        for e in events
        if e.data != "[DONE]"
    )


async def test_a_stage_that_rewrites_events_is_a_module_and_a_line_in_the_plan(
    monkeypatch: pytest.MonkeyPatch, mock: MockServer, start_sidecar: StartSidecar
) -> None:
    body = {"stream": True, "messages": [{"role": "user", "content": "hi"}]}
    app = Starlette(routes=[Route(CHAT, _app_stream, methods=["POST"])])
    async with httpx.AsyncClient() as client:
        direct = _answer((await client.post(mock.url + CHAT, json=body)).content)
    assert direct and direct != direct.upper()  # the upstream's own text: not shouted

    monkeypatch.setattr(pipeline, "STAGES", [*STAGES, Shout])  # the one line
    sidecar = await start_sidecar(mock.url)
    app.add_middleware(StreamWardenMiddleware)
    async with serve_in_process(app) as url, httpx.AsyncClient() as client:
        through_sidecar = await client.post(sidecar.proxy_url + CHAT, json=body)
        through_middleware = await client.post(url + CHAT, json=body)
    assert _answer(through_sidecar.content) == direct.upper()
    assert _answer(through_middleware.content) == "HI"  # the app's "hi"
    assert through_sidecar.content.endswith(b"data: [DONE]\n\n")
    assert through_middleware.content.endswith(b"data: [DONE]\n\n")


def test_the_docs_parity_table_is_generated_from_the_plan() -> None:
    start = "<!-- parity table: generated by `python -m streamwarden.pipeline` -->\n"
    end = "<!-- end of parity table -->"
    text = PARITY_PAGE.read_text()
    assert start in text and end in text
    published = text.split(start, 1)[1].split(end, 1)[0]
    assert published == parity_table() + "\n", "run: python -m streamwarden.pipeline"


def _flow() -> PipelineStream:
    from streamwarden.config import load_settings
    from streamwarden.core.plan import StreamPlan
    from streamwarden.observation.register import StreamRegister
    from streamwarden.pipeline import FaceServices, Pipeline

    settings = load_settings(environ={}, overrides={})
    register: StreamRegister[str] = StreamRegister()
    plan = StreamPlan("sse", "identity", "text/event-stream")
    start = StreamStart(
        "middleware", settings.for_path(CHAT), plan, "POST", CHAT, 200, (), {}, 0.0, 0.0
    )
    return Pipeline(FaceServices("middleware", settings), register).open(start)


def test_the_stages_headers_replace_any_of_the_same_name_in_both_faces() -> None:
    flow = _flow()
    flow.headers.append(("Streamwarden-Stream-Id", "ours"))
    # An app (or upstream) behind us that passes on another sidecar's id.
    sent = [("content-type", "text/event-stream"), ("streamwarden-stream-id", "theirs")]
    assert flow.head(sent) == [
        ("content-type", "text/event-stream"),
        ("Streamwarden-Stream-Id", "ours"),
    ]


def test_a_stop_before_the_face_can_act_acts_as_soon_as_it_can() -> None:
    flow = _flow()
    stopped: list[str] = []
    flow.stop()  # an owner's DELETE, before the face bound its stop
    flow.stop_by(lambda: stopped.append("stopped"))
    assert stopped == ["stopped"]
    flow.stop()
    assert stopped == ["stopped", "stopped"]
