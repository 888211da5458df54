"""Usage injection: exact token counts from an upstream that sends usage only on request.

OpenAI's API, vLLM and others stream a token count only when the request
sets ``stream_options.include_usage``. Without it the sidecar can only
estimate; with ``usage_injection: auto`` it asks for the count itself and
takes back what that changes, so the client's bytes stay as they were.
What "what that changes" is depends on the upstream: some send the usage
chunk, or ``"usage": null``, whether asked or not. The sidecar learns that
from one unchanged stream per kind of request (target, host, model,
credentials) before it changes any request of that kind, and takes back
only what the upstream would not have sent by itself. It is off by
default; every test here turns it on, and every client is a tenant with a
key (a request without credentials is never changed).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecars import StartSidecar
from streamwarden.core.usage import INCLUDE_USAGE
from streamwarden.pipeline.transforms import with_transforms
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from transparency_cases import BODIES_SENT_UNCHANGED as UNCHANGED
from transparency_cases import BODIES_SPLICED as SPLICED
from upstreams import ServeUpstream
from waiting import wait_for

CHAT = "/v1/chat/completions"
TOKENS = 12
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
#: A client's credentials: usage injection only ever changes a request that has some.
AUTH = {"Authorization": "Bearer tenant-a"}
MOCK = {"x-mock-tokens": str(TOKENS), "x-mock-tps": "0", "x-mock-ttft": "0", **AUTH}


def normalized(raw: bytes) -> bytes:
    # The mock stamps each answer with the second it was made.
    return re.sub(rb'"created":\d+', b'"created":0', raw)


async def raw_stream(url: str, body: dict[str, Any], request_id: str) -> bytes:
    async with httpx.AsyncClient() as client:
        headers = {**MOCK, "x-mock-request-id": request_id}
        response = await client.post(url + CHAT, json=body, headers=headers)
        return response.content


async def meter_of(sidecar: Sidecar, count: int) -> Any:
    await wait_for(lambda: len(sidecar.tracker.finished) == count)
    return sidecar.tracker.finished[-1].meter


async def test_without_injection_the_tokens_are_estimated(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, usage_injection="off")
    await raw_stream(sidecar.proxy_url, REQUEST, "plain")
    meter = await meter_of(sidecar, 1)
    assert meter.tokens_source == "estimated"


async def test_with_injection_the_count_is_the_providers_and_the_bytes_are_unchanged(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    direct = await raw_stream(mock.url, REQUEST, "same")
    sidecar = await start_sidecar(mock.url, usage_injection="auto")
    # The first stream on a path goes unchanged: it shows what the upstream
    # sends unasked (here: no usage), and so what the option will add.
    learning = await raw_stream(sidecar.proxy_url, REQUEST, "same")
    assert (await meter_of(sidecar, 1)).tokens_source == "estimated"
    through = await raw_stream(sidecar.proxy_url, REQUEST, "same")
    assert b'"usage"' not in direct  # the client never asked for usage
    assert normalized(through) == normalized(direct) == normalized(learning)  # nor sees any
    meter = await meter_of(sidecar, 2)
    assert meter.tokens_source == "provider"
    assert meter.tokens_generated == TOKENS
    upstream = mock.stats.records[-1]
    assert upstream.tokens_generated == TOKENS
    metrics = sidecar.metrics.render().decode()
    assert (
        'streamwarden_tokens_generated_total{dialect="openai-chat",source="provider"} 12.0'
        in metrics
    )


async def test_the_openai_sdk_sees_the_same_chunks_with_and_without_the_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, usage_injection="auto")

    async def chunks(base: str) -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={**MOCK, "x-mock-request-id": "sdk"},
        )
        got = [chunk.model_dump(exclude={"created"}) async for chunk in stream]
        await client.close()
        return got

    direct = await chunks(mock.url)
    assert await chunks(sidecar.proxy_url) == direct  # the habit learned
    assert await chunks(sidecar.proxy_url) == direct  # the option taken back
    assert (await meter_of(sidecar, 2)).tokens_source == "provider"


async def test_a_client_that_asked_for_usage_still_gets_it(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    asked = {**REQUEST, "stream_options": {"include_usage": True}}
    direct = await raw_stream(mock.url, asked, "asked")
    sidecar = await start_sidecar(mock.url, usage_injection="auto")
    through = await raw_stream(sidecar.proxy_url, asked, "asked")
    assert b'"choices":[],' in through and b'"usage":null' in through
    assert normalized(through) == normalized(direct)


class RecordingUpstream:
    """Records each request body; answers like OpenAI (or, ``old``, like vLLM before 0.5).

    Habits seen in the wild: ``forced`` sends the usage chunk whether asked
    or not (vLLM ``--enable-force-include-usage``, some hosted APIs),
    ``nulls`` writes ``"usage": null`` on every chunk whether asked or not,
    and ``marks`` (on by default, as OpenAI does) writes it when asked.
    ``like_vllm`` reads ``stream_options`` as vLLM does: present at all, it
    asks for usage unless ``include_usage`` is falsy (``1`` and ``"true"``
    are true). ``forced_for`` stands for a gateway that sends some requests
    to a backend that forces usage (by tenant, query, replica...).
    ``echoes`` answers a ``temperature`` above 2 with vLLM's validation
    error, which quotes the whole request back.
    """

    def __init__(
        self,
        *,
        old: bool = False,
        refuse: bool = False,
        forced: bool = False,
        nulls: bool = False,
        marks: bool = True,
        like_vllm: bool = False,
        forced_for: Callable[[web.Request], bool] | None = None,
        echoes: bool = False,
    ) -> None:
        self.old = old
        #: Answer every request 400 for a reason of its own (not the option).
        self.refuse = refuse
        self.forced = forced
        self.nulls = nulls
        self.marks = marks
        self.like_vllm = like_vllm
        self.forced_for = forced_for
        self.echoes = echoes
        self.bodies: list[bytes] = []
        self.lengths: list[str | None] = []
        self.app = web.Application()
        self.app.router.add_post(CHAT, self.chat)

    def asks_usage(self, options: Any) -> bool:
        if self.like_vllm:
            return isinstance(options, dict) and bool(options.get("include_usage", True))
        return isinstance(options, dict) and options.get("include_usage") is True

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.lengths.append(request.headers.get("Content-Length"))
        try:
            sent = json.loads(body)
        except (ValueError, RecursionError):
            sent = {}
        if not isinstance(sent, dict):
            sent = {}
        usage = self.asks_usage(sent.get("stream_options"))
        if self.refuse:
            return web.json_response({"error": {"message": "model not found"}}, status=400)
        if usage and self.old:
            error = {"object": "error", "message": "stream_options: extra fields not permitted"}
            return web.json_response(error, status=400)
        temperature = sent.get("temperature", 1)
        if self.echoes and isinstance(temperature, int | float) and temperature > 2:
            problem = {"type": "less_than_equal", "loc": ("body", "temperature"), "input": sent}
            error = {"object": "error", "message": str([problem]), "code": 400}
            return web.json_response(error, status=400)
        forced = self.forced or (self.forced_for is not None and self.forced_for(request))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ("a", "b", "c"):
            chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": token}}]}
            if self.nulls or (usage and self.marks):
                chunk["usage"] = None
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if usage or forced:
            final = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1}}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def post(
    url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """One request as a client sends it: ``body`` exactly these bytes, or as JSON."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    async with httpx.AsyncClient() as client:
        return await client.post(url + CHAT, content=content, headers=sent)


async def test_the_default_config_never_changes_a_request(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve_upstream(upstream.app))  # the defaults
    sent = json.dumps(REQUEST).encode()
    for _ in range(3):
        await post(sidecar.proxy_url, sent)
    assert upstream.bodies == [sent] * 3
    await wait_for(lambda: len(sidecar.tracker.finished) == 3)
    assert {r.meter.tokens_source for r in sidecar.tracker.finished} == {"estimated"}


async def test_the_upstream_receives_the_body_with_the_option_added_and_its_length(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    sent = b'{"model": "m",\n "stream": true}\r\n'
    responses = [await post(sidecar.proxy_url, sent) for _ in range(2)]
    # The client's bytes, the member spliced in before the closing brace.
    expected = b'{"model": "m",\n "stream": true,"stream_options":{"include_usage":true}}\r\n'
    assert upstream.bodies == [sent, expected]  # the first one shows the habit
    assert upstream.lengths == [str(len(sent)), str(len(expected))]
    for response in responses:
        assert b"usage" not in response.content and response.content.count(b"data: ") == 4
    assert (await meter_of(sidecar, 2)).tokens_generated == 3
    assert sidecar.tracker.finished[-1].meter.tokens_source == "provider"


async def test_a_request_without_credentials_is_never_changed_and_teaches_nothing(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    sent = json.dumps(REQUEST).encode()
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            await client.post(sidecar.proxy_url + CHAT, content=sent)
    assert upstream.bodies == [sent] * 3


def body_ids(cases: list[tuple[str, bytes]]) -> list[str]:
    return [name for name, _ in cases]


@pytest.mark.parametrize("sent", [body for _, body in UNCHANGED], ids=body_ids(UNCHANGED))
async def test_bodies_it_cannot_rewrite_with_certainty_go_unchanged(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, sent: bytes
) -> None:
    upstream = RecordingUpstream()
    url = await serve_upstream(upstream.app)
    direct = await post(url, sent)
    sidecar = await start_sidecar(url, usage_injection="auto")
    await post(sidecar.proxy_url, REQUEST)  # the kind's habit learned: the next may change
    through = await post(sidecar.proxy_url, sent)
    assert upstream.bodies[-1] == sent
    assert through.status_code == direct.status_code == 200
    assert through.content == direct.content


@pytest.mark.parametrize("sent", [body for _, body in SPLICED], ids=body_ids(SPLICED))
async def test_a_body_it_rewrites_reaches_the_upstream_as_sent_plus_the_member(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, sent: bytes
) -> None:
    upstream = RecordingUpstream()
    url = await serve_upstream(upstream.app)
    direct = await post(url, sent)
    sidecar = await start_sidecar(url, usage_injection="auto")
    await post(sidecar.proxy_url, REQUEST)
    through = await post(sidecar.proxy_url, sent)
    assert through.status_code == direct.status_code == 200  # never a 5xx of ours
    assert through.content == direct.content
    assert upstream.bodies[-1] == sent[:-1] + INCLUDE_USAGE + b"}"
    assert sidecar.tracker.finished[-1].meter.tokens_source == "provider"


@pytest.mark.parametrize(
    "signed",
    [
        {"x-amz-content-sha256": "e3b0c44298fc1c149afbf4c8996fb924"},
        {"Content-Digest": "sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:"},
        {"Authorization": "AWS4-HMAC-SHA256 Credential=AKID/20261205/us-east-1/bedrock"},
    ],
    ids=["sigv4-payload", "content-digest", "sigv4"],
)
async def test_a_body_signed_or_digested_goes_unchanged(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, signed: dict[str, str]
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    sent = json.dumps(REQUEST).encode()
    await post(sidecar.proxy_url, sent, signed)  # the kind learned
    await post(sidecar.proxy_url, sent, signed)
    assert upstream.bodies == [sent, sent]  # a changed body would fail its signature


async def test_a_body_over_the_bound_goes_unchanged_and_whole(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(
        await serve_upstream(upstream.app),
        usage_injection="auto",
        usage_injection_max_body_bytes="1KiB",
    )
    big = json.dumps({"model": "m", "stream": True, "messages": [{"content": "x" * 5000}]})

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: read to the bound
        for start in range(0, len(big), 700):
            yield big[start : start + 700].encode()

    await post(sidecar.proxy_url, REQUEST)
    async with httpx.AsyncClient() as client:
        await client.post(sidecar.proxy_url + CHAT, content=chunked(), headers=AUTH)
        await client.post(sidecar.proxy_url + CHAT, content=big.encode(), headers=AUTH)
    assert upstream.bodies[1:] == [big.encode(), big.encode()]


async def test_an_upstream_that_refuses_the_option_gets_the_request_unchanged_and_is_remembered(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream(old=True)
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    sent = json.dumps(REQUEST).encode()
    answers = [await post(sidecar.proxy_url, sent) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert len({answer.content for answer in answers}) == 1
    assert answers[0].content.endswith(b"data: [DONE]\n\n")
    # Unchanged to learn the habit; then injected once, refused, sent again
    # unchanged; then left alone.
    assert [b"include_usage" in body for body in upstream.bodies] == [False, True, False, False]
    assert upstream.bodies[2:] == [sent, sent]


async def test_another_400_reaches_the_client_as_it_came(
    start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    upstream = RecordingUpstream(refuse=True)
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    response = await post(sidecar.proxy_url, REQUEST)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "model not found"}}
    assert len(upstream.bodies) == 1  # not sent twice: the option was not the problem


async def test_a_400_that_quotes_the_request_is_the_clients_and_the_request_goes_once(
    start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    upstream = RecordingUpstream(echoes=True)
    sidecar = await start_sidecar(await serve_upstream(upstream.app), usage_injection="auto")
    await post(sidecar.proxy_url, REQUEST)  # learned: the next is injected
    hot = {**REQUEST, "temperature": 5}
    direct = await post(await serve_upstream(RecordingUpstream(echoes=True).app), hot)
    through = await post(sidecar.proxy_url, hot)
    # vLLM's validation error quotes the request, the added member with it:
    # not a refusal of the option, so not a reason to send the request again.
    assert b"'stream_options': {'include_usage': True}" in through.content
    assert through.status_code == direct.status_code == 400
    assert len(upstream.bodies) == 2
    # And the kind is not taken for one that refuses the option.
    await post(sidecar.proxy_url, REQUEST)
    assert b"include_usage" in upstream.bodies[-1]


def test_a_usage_only_chunk_without_a_completion_count_is_hidden_too() -> None:
    from streamwarden.core.relay import Limits, Relay
    from streamwarden.core.usage import TakeBack

    relay = with_transforms(
        Relay(
            Limits(15.0, 60.0, 1800.0, 1 << 20),
            started_at=0.0,
            now=0.0,
            path=CHAT,
            content_type="text/event-stream",
            headers={},
        ),
        usage=TakeBack(),
    )
    assert relay.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n', 0.1) == b""
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    assert relay.feed(chunk, 0.2) == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'


async def chat_bodies(
    url: str, count: int, body: dict[str, Any] = REQUEST, headers: dict[str, str] | None = None
) -> list[bytes]:
    return [(await post(url, body, headers)).content for _ in range(count)]


@pytest.mark.parametrize(
    "habit",
    [
        {"forced": True, "marks": False},  # vLLM --enable-force-include-usage
        {"forced": True},  # a hosted API that sends usage always, nulls when asked
        {"forced": True, "nulls": True},  # ... and "usage": null on every chunk
        {"nulls": True},  # "usage": null always, the usage chunk only when asked
        {"marks": False},  # the usage chunk only when asked, no nulls (vLLM)
        {},  # OpenAI: both only when asked
    ],
    ids=["forced", "forced-marks", "forced-nulls", "nulls", "vllm", "openai"],
)
async def test_the_client_gets_every_byte_the_upstream_sends_it_unasked(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, habit: dict[str, bool]
) -> None:
    upstream = RecordingUpstream(**habit)
    url = await serve_upstream(upstream.app)
    (direct,) = await chat_bodies(url, 1)
    sidecar = await start_sidecar(url, usage_injection="auto")
    through = await chat_bodies(sidecar.proxy_url, 3)
    assert through == [direct] * 3
    await wait_for(lambda: len(sidecar.tracker.finished) == 3)
    meters = [record.meter for record in sidecar.tracker.finished]
    if habit.get("forced"):
        # The count comes anyway: never asked for, on every stream.
        assert b'"choices": [], "usage"' in direct
        assert [b"include_usage" in body for body in upstream.bodies[1:]] == [False] * 3
        assert [meter.tokens_source for meter in meters] == ["provider"] * 3
    else:
        # Learned from the first, asked for and taken back on the others.
        assert [b"include_usage" in body for body in upstream.bodies[1:]] == [False, True, True]
        assert [meter.tokens_source for meter in meters] == ["estimated", "provider", "provider"]
    assert all(meter.tokens_generated == 3 for meter in meters)


# -- one client cannot change what another receives --------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"include_usage": 1}, {"include_usage": "true"}],
    ids=["empty", "one", "string-true"],
)
async def test_a_stream_options_shape_the_upstream_reads_otherwise_teaches_nothing(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, options: dict[str, Any]
) -> None:
    # vLLM takes any stream_options object as asking for usage unless it
    # says include_usage false; the sidecar never reads a shape for it.
    upstream = RecordingUpstream(like_vllm=True, marks=False)
    url = await serve_upstream(upstream.app)
    victim = {**REQUEST, "stream_options": options}
    (direct,) = await chat_bodies(url, 1, victim)
    assert b'"choices": [], "usage"' in direct
    sidecar = await start_sidecar(url, usage_injection="auto")
    teacher = {**REQUEST, "stream_options": {"include_usage": False}}
    await chat_bodies(sidecar.proxy_url, 2, teacher)  # no usage comes: "a kind that sends none"
    assert await chat_bodies(sidecar.proxy_url, 2, victim) == [direct] * 2
    assert all(b'include_usage":true' not in body for body in upstream.bodies[1:])


@pytest.mark.parametrize(
    ("victim", "routes"),
    [
        ({"Authorization": "Bearer tenant-b"}, "credentials"),
        ({"x-goog-api-key": "tenant-b"}, "credentials"),
        ({"x-tenant": "b"}, "query"),
    ],
    ids=["authorization", "goog-api-key", "query"],
)
async def test_a_gateways_other_backend_is_learned_on_its_own(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar, victim: dict[str, str], routes: str
) -> None:
    """A gateway sends tenant b (by key, or by query) to a backend that forces usage."""

    def to_b(request: web.Request) -> bool:
        if routes == "query":
            return request.query.get("tenant") == "b"
        return "tenant-b" in (
            request.headers.get("Authorization", "") + request.headers.get("x-goog-api-key", "")
        )

    upstream = RecordingUpstream(forced_for=to_b)
    url = await serve_upstream(upstream.app)
    target = "?tenant=b" if routes == "query" else ""
    headers = {} if routes == "query" else victim

    async def victims(base: str, count: int) -> list[bytes]:
        async with httpx.AsyncClient() as client:
            sent = {**AUTH, **headers}
            return [
                (await client.post(base + CHAT + target, json=REQUEST, headers=sent)).content
                for _ in range(count)
            ]

    (direct,) = await victims(url, 1)
    assert b'"choices": [], "usage"' in direct
    sidecar = await start_sidecar(url, usage_injection="auto")
    await chat_bodies(sidecar.proxy_url, 2)  # tenant a's backend sends no usage unasked
    assert await victims(sidecar.proxy_url, 2) == [direct] * 2


async def test_a_flood_of_kinds_cannot_push_out_what_was_learned(
    serve_upstream: ServeUpstream, start_sidecar: StartSidecar
) -> None:
    """Behind one address, a replica that forces usage and one that does not.

    What the sidecar learned of the kind from the first (it volunteers
    usage: never inject) stays, whatever other kinds come after, so a
    later lesson from the second cannot make it take the first's count back.
    """
    upstream = RecordingUpstream(forced_for=lambda r: r.headers.get("x-replica") == "forcing")
    url = await serve_upstream(upstream.app)
    forcing = {"x-replica": "forcing"}
    (direct,) = await chat_bodies(url, 1, headers=forcing)
    assert b'"choices": [], "usage"' in direct
    sidecar = await start_sidecar(url, usage_injection="auto")
    await chat_bodies(sidecar.proxy_url, 1, headers=forcing)  # learned: it volunteers
    async with httpx.AsyncClient() as client:
        for n in range(300):  # more kinds than the table of old held
            flood = {**REQUEST, "model": f"flood-{n}"}
            await client.post(sidecar.proxy_url + CHAT, json=flood, headers=AUTH)
    await chat_bodies(sidecar.proxy_url, 1, headers={"x-replica": "plain"})
    assert await chat_bodies(sidecar.proxy_url, 1, headers=forcing) == [direct]


KEY = (CHAT, "127.0.0.1", "m", "digest")


def _frame(raw: bytes) -> Any:
    from streamwarden.core.sse import Event, Frame

    return Frame(raw, Event("message", raw.decode().removeprefix("data: ").strip(), None))


def test_a_habit_is_learned_from_a_whole_stream_and_again_after_its_memory() -> None:
    from streamwarden.core.dialects.base import NOTHING, TERMINAL
    from streamwarden.core.usage import HabitWatch, TakeBack, UsageHabits

    habits = UsageHabits(memory=60.0)
    watch = habits.role(KEY, 0.0)
    assert isinstance(watch, HabitWatch)
    watch.see(_frame(b'data: {"choices":[],"usage":null}\n\n'), NOTHING, 1.0)
    assert isinstance(habits.role(KEY, 1.0), HabitWatch)  # not yet known
    watch.see(_frame(b"data: [DONE]\n\n"), TERMINAL, 2.0)  # whole, with nulls, no count
    assert habits.role(KEY, 3.0) == TakeBack(chunk=True, nulls=False)
    assert isinstance(habits.role(KEY, 62.0), HabitWatch)  # learned again


def test_a_full_table_learns_no_new_kind_and_keeps_the_old() -> None:
    from streamwarden.core.usage import HabitWatch, TakeBack, UsageHabit, UsageHabits

    habits = UsageHabits(memory=60.0, kinds=2)
    habits.learn(KEY, UsageHabit(volunteers=True, marks_null=False), 0.0)
    habits.learn(("/a", "h", "m", "d"), UsageHabit(volunteers=False, marks_null=False), 1.0)
    # Full: a new kind is neither watched nor learned; it goes unchanged.
    assert habits.role(("/b", "h", "m", "d"), 2.0) is None
    habits.learn(("/b", "h", "m", "d"), UsageHabit(volunteers=False, marks_null=False), 2.0)
    assert habits.role(("/b", "h", "m", "d"), 3.0) is None
    assert habits.role(KEY, 3.0) is None  # still known: it volunteers
    assert habits.role(("/a", "h", "m", "d"), 3.0) == TakeBack()
    # The first expires, and makes room.
    assert isinstance(habits.role(("/b", "h", "m", "d"), 60.5), HabitWatch)


def test_one_credential_fills_its_own_share_of_the_table_not_everyones() -> None:
    from streamwarden.core.usage import (
        HABIT_KINDS_PER_CREDENTIAL,
        HabitWatch,
        UsageHabit,
        UsageHabits,
    )

    habits = UsageHabits(memory=60.0, kinds=HABIT_KINDS_PER_CREDENTIAL * 4)
    # One authenticated client names model after model, then has one refused.
    for n in range(HABIT_KINDS_PER_CREDENTIAL * 4):
        habits.learn((CHAT, "h", f"model-{n}", "mallory"), UsageHabit(False, False), 0.0)
    habits.refused((CHAT, "h", "one-more", "mallory"), 0.0)
    assert habits.role((CHAT, "h", "yet-another", "mallory"), 1.0) is None  # its share is full
    # Another client's kinds are still learned.
    assert isinstance(habits.role((CHAT, "h", "gpt-4o", "alice"), 1.0), HabitWatch)
    habits.learn((CHAT, "h", "gpt-4o", "alice"), UsageHabit(False, False), 1.0)
    assert habits.role((CHAT, "h", "gpt-4o", "alice"), 2.0) is not None
    # Its share comes back as its kinds expire.
    assert isinstance(habits.role((CHAT, "h", "yet-another", "mallory"), 60.5), HabitWatch)


def test_a_refusal_is_remembered_from_when_it_came() -> None:
    from streamwarden.core.usage import TakeBack, UsageHabit, UsageHabits

    habits = UsageHabits(memory=600.0)
    habits.learn(KEY, UsageHabit(volunteers=False, marks_null=False), 0.0)
    assert habits.role(KEY, 590.0) == TakeBack()
    habits.refused(KEY, 599.0)  # refused just before the habit would expire
    assert habits.role(KEY, 650.0) is None  # still left alone, not learned anew


def test_a_habit_only_learns_towards_leaving_bytes_alone() -> None:
    from streamwarden.core.usage import HabitWatch, UsageHabit, UsageHabits

    habits = UsageHabits(memory=60.0)
    habits.learn(KEY, UsageHabit(volunteers=True, marks_null=False), 0.0)
    # A later (or a stale) stream that showed no count, say a client's own
    # pick of a model that sends none, cannot make the sidecar take back
    # the count another stream's upstream sends by itself.
    habits.learn(KEY, UsageHabit(volunteers=False, marks_null=False), 1.0)
    assert habits.role(KEY, 2.0) is None
    # The model is part of the key: another model behind the same path is its own lesson.
    assert isinstance(habits.role((CHAT, "127.0.0.1", "other", "digest"), 2.0), HabitWatch)


def test_a_kind_is_keyed_by_its_credentials_and_holds_none_of_them() -> None:
    from streamwarden.core.usage import UsageHabits

    habits = UsageHabits()
    a = habits.key(CHAT, "h", "m", ["authorization=Bearer sk-a"])
    b = habits.key(CHAT, "h", "m", ["authorization=Bearer sk-b"])
    assert a is not None and b is not None and a != b
    assert a == habits.key(CHAT, "h", "m", ["authorization=Bearer sk-a"])
    assert "sk-a" not in repr(a)
    # Nor does the target keep a credential of the query.
    in_query = habits.key(CHAT + "?key=sk-q", "h", "m", ["?key=sk-q"])
    assert in_query is not None and "sk-q" not in repr(in_query)
    assert habits.key(CHAT, "h", "m", []) is None  # no credentials: never injected


def test_a_stream_with_an_error_teaches_no_habit() -> None:
    from streamwarden.core.dialects.base import UPSTREAM_ERROR
    from streamwarden.core.usage import HabitWatch, UsageHabits

    habits = UsageHabits()
    watch = habits.role(KEY, 0.0)
    assert isinstance(watch, HabitWatch)
    # vLLM's error event, then [DONE] and no usage: not what a whole stream sends.
    watch.see(_frame(b'data: {"error":{"message":"x"}}\n\n'), UPSTREAM_ERROR, 1.0)
    assert watch.settled
    assert isinstance(habits.role(KEY, 2.0), HabitWatch)


@pytest.mark.parametrize(
    ("body", "injected"),
    [
        (b'{"model":"m","stream":true}', True),
        # Any stream_options of the client's: the upstream reads it its own way.
        (b'{"model":"m","stream":true,"stream_options":{"include_usage":false}}', False),
        (b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}', False),
        (b'{"model":"' + b"m" * 300 + b'","stream":true}', False),  # a model name past the bound
        (b'{"model":7,"stream":true}', False),
    ],
    ids=["plain", "include-false", "continuous", "long-model", "odd-model"],
)
def test_which_bodies_are_asked_for_usage(body: bytes, injected: bool) -> None:
    from streamwarden.core.usage import usage_request

    asked = usage_request(body)
    assert (asked is not None) == injected
    if asked is not None:
        assert asked.injected == body[:-1] + INCLUDE_USAGE + b"}"


# JSON values, every kind, nested; strings with what clients write (escapes,
# lone surrogates, non-ASCII); numbers in every spelling JSON allows.
_NUMBERS = st.from_regex(r"\A-?(0|[1-9][0-9]{0,20})(\.[0-9]{1,10})?([eE][+-]?[0-9]{1,3})?\Z")
_STRINGS = st.text(st.characters(codec="utf-8") | st.sampled_from(["\ud83d", "\udc00", "\n"]))
_VALUES = st.recursive(
    # As values, only what json.dumps writes back as JSON (not Infinity).
    st.none() | st.booleans() | _NUMBERS.map(json.loads).filter(math.isfinite) | _STRINGS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_STRINGS, inner, max_size=4),
    max_leaves=20,
)


def _written(value: Any, ascii_only: bool, spaced: bool) -> str:
    separators = (", ", ": ") if spaced else (",", ":")
    return json.dumps(value, ensure_ascii=ascii_only, separators=separators)


@settings(max_examples=300, deadline=None)
@given(
    members=st.dictionaries(_STRINGS, _VALUES, max_size=5),
    number=_NUMBERS,
    ascii_only=st.booleans(),
    spaced=st.booleans(),
    trailing=st.sampled_from(["", "\n", " \r\n\t"]),
)
def test_the_rewrite_adds_its_member_and_changes_no_other_byte(
    members: dict[str, Any], number: str, ascii_only: bool, spaced: bool, trailing: str
) -> None:
    from streamwarden.core.usage import usage_request

    # Names that fold alike ("n" and "N", "stream" and "ſtream") leave a body
    # unchanged by design (tested on their own): not this property's case.
    folded = {"stream", "model", "n"}
    kept = {}
    for k, v in members.items():
        if k.casefold() not in folded:
            folded.add(k.casefold())
            kept[k] = v
    members = kept
    # The number as the client spelt it (1E0, 1e400): never re-written.
    text = (
        '{"model":"m","n":'
        + number
        + ',"stream":true'
        + "".join(
            f",{_written(k, ascii_only, spaced)}:{_written(v, ascii_only, spaced)}"
            for k, v in members.items()
        )
        + "}"
        + trailing
    )
    try:
        body, utf8 = text.encode("utf-8"), True
    except UnicodeEncodeError:  # a raw lone surrogate: not UTF-8, must go unchanged
        body, utf8 = text.encode("utf-8", "surrogatepass"), False
    asked = usage_request(body)
    if not utf8 or "stream_options" in json.dumps(members):
        assert asked is None
        return
    assert asked is not None
    end = len(body) - len(trailing)
    assert asked.injected == body[: end - 1] + INCLUDE_USAGE + body[end - 1 :]
    rewritten = json.loads(asked.injected)
    assert rewritten.pop("stream_options") == {"include_usage": True}
    assert json.dumps(rewritten, sort_keys=True) == json.dumps(json.loads(body), sort_keys=True)


async def test_a_stream_cut_before_its_end_teaches_no_habit(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, usage_injection="auto")
    async with httpx.AsyncClient() as client:
        headers = {**MOCK, "x-mock-fault": "truncate"}
        await client.post(sidecar.proxy_url + CHAT, json=REQUEST, headers=headers)
    await raw_stream(sidecar.proxy_url, REQUEST, "after-the-cut")
    await wait_for(lambda: len(sidecar.tracker.finished) == 2)
    # Both went unchanged: a truncated stream shows nothing of what comes at the end.
    assert [r.meter.tokens_source for r in sidecar.tracker.finished] == ["estimated"] * 2


def test_two_sets_of_query_credentials_never_join_into_one_kind() -> None:
    from streamwarden.core.headers import credential_parts
    from streamwarden.core.usage import UsageHabits

    habits = UsageHabits()

    def kind(query: str) -> Any:
        return habits.key(CHAT, "h", "m", credential_parts([], query))

    # A NUL and a "?key" decoded into one value must not spell two values.
    assert kind("key=a&key=b") != kind("key=a%00%3Fkey%3Db")
    assert kind("key=a&key=b") != kind("key=a%00%3Fkey%00b")
    assert kind("key=%FF") != kind("key=%FE")
    assert kind("KEY=a") == kind("key=a")  # names in any case, as owners read them
