"""Transparency, differentially: what a client reads through streamwarden is what it reads without.

For every recorded provider stream, every habit of OpenAI-compatible
servers seen in the wild (usage always sent, with or without ``"usage":
null`` on each chunk, never sent, sent only when asked, n > 1 choices) and
generic shapes of event streams (upstream ids, ``retry:``, the upstream's
own comments, CRLF and CR line ends, a BOM, gzip, a JSON body answered to a
streaming request), the same request is sent directly to an upstream that
replays it and through streamwarden with its default config: through the
sidecar (three times, since a sidecar may learn per route) and through the
middleware (the same answer from an ASGI app under uvicorn, with and
without it). The bodies must be equal byte for byte, apart from the
documented additions (keep-alive comments between events; a failure's
error event and resume ids do not occur here). Then the mock upstream's
every dialect through the sidecar, and a force-usage upstream, whose usage
chunk the client must get while the meter counts the provider's tokens.

Usage injection is on by default, so every OpenAI chat case is sent both
without ``stream_options`` (the sidecar adds the option and must take back
exactly what it added, no more) and with ``include_usage`` (the client's
own, passed on). The replay upstream reads the request and answers as a
real server with that habit would.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio

from middleware_apps import serve_in_process
from sidecars import StartSidecar, sidecars
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import MockServer, start_mock
from transparency_cases import (
    BOM,
    CASE_HEADER,
    CASES,
    KEEPALIVE,
    Case,
    Framing,
    ReplayUpstream,
    Variant,
    assert_same_events,
    replay_app,
    request_body,
    sse_events,
    variants,
)
from upstreams import serving
from waiting import wait_for

# One event loop for the module: the upstreams and uvicorn servers are shared
# by all tests (a uvicorn takes 0.2 s to stop); each test gets its own sidecar.
pytestmark = pytest.mark.asyncio(loop_scope="module")

SENDS = 3


@dataclass(frozen=True, slots=True)
class Faces:
    """The replay served as the app, without the middleware and with it."""

    plain: str
    guarded: str
    middleware: StreamWardenMiddleware


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as session:
        yield session


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replay() -> AsyncIterator[str]:
    async with serving(ReplayUpstream(CASES).app, access_log=None) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def faces() -> AsyncIterator[Faces]:
    middleware = StreamWardenMiddleware(replay_app(CASES))  # the defaults: no options
    async with serve_in_process(replay_app(CASES)) as plain:
        async with serve_in_process(middleware) as guarded:
            yield Faces(plain, guarded, middleware)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mock_upstream() -> AsyncIterator[MockServer]:
    server = await start_mock()
    yield server
    await server.close()


@pytest_asyncio.fixture(loop_scope="module")
async def start_sidecar() -> AsyncIterator[StartSidecar]:
    """conftest's ``start_sidecar``, on the module's loop (a fixture runs on its own loop scope)."""
    async with sidecars() as start:
        yield start


async def ask(client: httpx.AsyncClient, base: str, case: Case, asks_usage: bool) -> httpx.Response:
    return await client.post(
        base + case.path,
        content=request_body(asks_usage),
        headers={"Content-Type": "application/json", CASE_HEADER: case.name},
    )


def assert_same_answer(
    direct: httpx.Response, through: httpx.Response, case: Case, what: str
) -> None:
    assert through.status_code == direct.status_code, what
    assert through.headers.get("content-type") == direct.headers.get("content-type"), what
    assert_same_events(direct.content, through.content, case.framing, what)


VARIANTS = variants(CASES)


async def test_the_comparison_allows_only_the_documented_additions() -> None:
    direct = b": the upstream's own\n\ndata: a\n\ndata: b\n\n"
    assert_same_events(direct, KEEPALIVE + direct + KEEPALIVE, "sse", "keep-alives")
    assert_same_events(BOM + direct, direct, "sse", "the leading BOM stripped")
    wrong = [
        direct.replace(b"data: a\n", b"data: a\n" + KEEPALIVE),  # inside an event
        direct.replace(b": the upstream's own\n\n", b""),
        direct.replace(b"\n", b"\r\n"),
        direct + b"data: c\n\n",
    ]
    for through in wrong:
        with pytest.raises(AssertionError):
            assert_same_events(direct, through, "sse", "changed")
    with pytest.raises(AssertionError):
        assert_same_events(b'{"a":1}\n', KEEPALIVE + b'{"a":1}\n', "lines", "not an SSE stream")
    with pytest.raises(AssertionError):
        assert_same_events(b'{"a": 1}', b'{"a":1}', "whole", "a whole body")


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.id for v in VARIANTS])
async def test_the_sidecar_passes_every_stream_unchanged(
    variant: Variant, replay: str, start_sidecar: StartSidecar, client: httpx.AsyncClient
) -> None:
    case = variant.case
    direct = await ask(client, replay, case, variant.asks_usage)
    assert direct.status_code == 200
    sidecar = await start_sidecar(replay)  # the default config
    for n in range(1, SENDS + 1):
        through = await ask(client, sidecar.proxy_url, case, variant.asks_usage)
        assert_same_answer(direct, through, case, f"through the sidecar, send {n}")


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.id for v in VARIANTS])
async def test_the_middleware_passes_every_stream_unchanged(
    variant: Variant, faces: Faces, client: httpx.AsyncClient
) -> None:
    case = variant.case
    direct = await ask(client, faces.plain, case, variant.asks_usage)
    assert direct.status_code == 200
    through = await ask(client, faces.guarded, case, variant.asks_usage)
    assert_same_answer(direct, through, case, "through the middleware")


# -- the mock upstream, every dialect -----------------------------------------------------

MOCK_CONTROLS = {"x-mock-tokens": "8", "x-mock-tps": "0", "x-mock-ttft": "0"}
MOCK_BODY = (
    b'{"model": "m", "stream": true, "max_tokens": 64, "prompt": "hi",'
    b' "messages": [{"role": "user", "content": "hi"}], "contents": [{"parts": [{"text": "hi"}]}]}'
)
MOCK_ASKS_USAGE = MOCK_BODY.replace(b"{", b'{"stream_options": {"include_usage": true}, ', 1)
# (name, method, path, body, extra headers)
MOCK_CASES: list[tuple[str, str, str, bytes, dict[str, str]]] = [
    ("openai-chat", "POST", "/v1/chat/completions", MOCK_BODY, {}),
    ("openai-chat-asks-usage", "POST", "/v1/chat/completions", MOCK_ASKS_USAGE, {}),
    ("openai-chat-tool-call", "POST", "/v1/chat/completions", MOCK_BODY, {"x-mock-tool-call": "1"}),
    ("openai-responses", "POST", "/v1/responses", MOCK_BODY, {}),
    ("anthropic", "POST", "/v1/messages", MOCK_BODY, {}),
    ("anthropic-tool-call", "POST", "/v1/messages", MOCK_BODY, {"x-mock-tool-call": "1"}),
    ("gemini", "POST", "/v1beta/models/m:streamGenerateContent?alt=sse", MOCK_BODY, {}),
    ("ollama-chat", "POST", "/api/chat", MOCK_BODY, {}),
    ("ollama-generate", "POST", "/api/generate", MOCK_BODY, {}),
    ("vercel-data-stream", "POST", "/vercel/data-stream", MOCK_BODY, {}),
    ("vercel-ui-stream", "POST", "/vercel/ui-stream", MOCK_BODY, {}),
    ("tgi", "POST", "/generate_stream", MOCK_BODY, {}),
    ("generic", "GET", "/sse", b"", {}),
]
# The mock stamps each answer with the second it was made: the only bytes that
# may differ between two of its answers to the same request.
_CREATED = re.compile(rb'"created(?:_at)?":(?:\d+|"[^"]*")')


def unstamped(body: bytes) -> bytes:
    return _CREATED.sub(b'"created":0', body)


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [case[1:] for case in MOCK_CASES],
    ids=[case[0] for case in MOCK_CASES],
)
async def test_the_mocks_streams_pass_the_sidecar_unchanged(
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    mock_upstream: MockServer,
    start_sidecar: StartSidecar,
    client: httpx.AsyncClient,
    request: pytest.FixtureRequest,
) -> None:
    sent = {**MOCK_CONTROLS, **headers, "x-mock-request-id": request.node.callspec.id}

    async def answer(base: str) -> httpx.Response:
        return await client.request(method, base + path, content=body or None, headers=sent)

    direct = await answer(mock_upstream.url)
    assert direct.status_code == 200
    framing: Framing = "lines" if b"\n\n" not in direct.content else "sse"
    sidecar = await start_sidecar(mock_upstream.url)
    for n in range(1, SENDS + 1):
        through = await answer(sidecar.proxy_url)
        assert through.status_code == 200
        assert through.headers["content-type"] == direct.headers["content-type"]
        what = f"the mock through the sidecar, send {n}"
        assert_same_events(unstamped(direct.content), unstamped(through.content), framing, what)


# -- a force-usage upstream ----------------------------------------------------------------

FORCE_USAGE = ["force-usage", "force-usage-with-nulls"]


def usage_chunks(body: bytes) -> list[str]:
    return [data for _, data, _ in sse_events(body) if '"choices":[]' in data]


def force_usage_case(name: str) -> Case:
    (case,) = [c for c in CASES if c.name == f"habit/{name}"]
    return case


@pytest.mark.parametrize("habit", FORCE_USAGE)
async def test_a_force_usage_upstreams_usage_chunk_reaches_the_client_through_the_sidecar(
    habit: str, replay: str, start_sidecar: StartSidecar, client: httpx.AsyncClient
) -> None:
    case = force_usage_case(habit)
    direct = await ask(client, replay, case, asks_usage=False)
    # The problem's shape: the upstream counts whatever the client asked.
    assert len(sse_events(direct.content)) == 9 and len(usage_chunks(direct.content)) == 1
    sidecar = await start_sidecar(replay, usage_injection="auto")
    bodies = [(await ask(client, sidecar.proxy_url, case, False)).content for _ in range(SENDS)]
    await wait_for(lambda: len(sidecar.tracker.finished) == SENDS, what="the streams recorded")
    meter = sidecar.tracker.finished[-1].meter
    assert (meter.tokens_source, meter.tokens_generated) == ("provider", 5)
    metrics = sidecar.metrics.render().decode()
    expected = 'streamwarden_tokens_generated_total{dialect="openai-chat",source="provider"} 15.0'
    assert expected in metrics
    for n, body in enumerate(bodies, 1):
        got = len(sse_events(body))
        assert got == 9, f"send {n}: {got} events of 9"
        assert usage_chunks(body) == usage_chunks(direct.content), f"send {n}"


@pytest.mark.parametrize("habit", FORCE_USAGE)
async def test_a_force_usage_upstreams_usage_chunk_reaches_the_client_through_the_middleware(
    habit: str, faces: Faces, client: httpx.AsyncClient
) -> None:
    case = force_usage_case(habit)
    before = len(faces.middleware.streams.finished)
    direct = await ask(client, faces.plain, case, asks_usage=False)
    through = await ask(client, faces.guarded, case, asks_usage=False)
    assert len(sse_events(direct.content)) == 9
    assert len(sse_events(through.content)) == 9
    assert usage_chunks(through.content) == usage_chunks(direct.content)
    streams = faces.middleware.streams
    await wait_for(lambda: len(streams.finished) > before, what="the stream recorded")
    meter = streams.finished[-1].meter
    assert (meter.tokens_source, meter.tokens_generated) == ("provider", 5)
