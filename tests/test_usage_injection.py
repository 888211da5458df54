"""Usage injection: exact token counts from an upstream that sends usage only on request.

OpenAI's API, vLLM and others stream a token count only when the request
sets ``stream_options.include_usage``. Without it the sidecar can only
estimate; with ``usage_injection: auto`` it asks for the count itself and
takes back what that changes, so the client's bytes stay as they were.
What "what that changes" is depends on the upstream: some send the usage
chunk, or ``"usage": null``, whether asked or not. The sidecar learns that
from one unchanged stream per path before it changes any request there,
and takes back only what the upstream would not have sent by itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_for

StartSidecar = Callable[..., Awaitable[Sidecar]]
CHAT = "/v1/chat/completions"
TOKENS = 12
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
MOCK = {"x-mock-tokens": str(TOKENS), "x-mock-tps": "0", "x-mock-ttft": "0"}


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
    sidecar = await start_sidecar(mock.url)  # usage_injection: auto is the default
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
    sidecar = await start_sidecar(mock.url)

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
    sidecar = await start_sidecar(mock.url)
    through = await raw_stream(sidecar.proxy_url, asked, "asked")
    assert b'"choices":[],' in through and b'"usage":null' in through
    assert normalized(through) == normalized(direct)


class RecordingUpstream:
    """Records each request body; answers like OpenAI (or, ``old``, like vLLM before 0.5).

    Habits seen in the wild: ``forced`` sends the usage chunk whether asked
    or not (vLLM ``--enable-force-include-usage``, some hosted APIs),
    ``nulls`` writes ``"usage": null`` on every chunk whether asked or not,
    and ``marks`` (on by default, as OpenAI does) writes it when asked.
    """

    def __init__(
        self,
        *,
        old: bool = False,
        refuse: bool = False,
        forced: bool = False,
        nulls: bool = False,
        marks: bool = True,
    ) -> None:
        self.old = old
        #: Answer every request 400 for a reason of its own (not the option).
        self.refuse = refuse
        self.forced = forced
        self.nulls = nulls
        self.marks = marks
        self.bodies: list[bytes] = []
        self.lengths: list[str | None] = []
        self.app = web.Application()
        self.app.router.add_post(CHAT, self.chat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.lengths.append(request.headers.get("Content-Length"))
        try:
            sent = json.loads(body)
        except ValueError:
            sent = {}
        options = sent.get("stream_options") if isinstance(sent, dict) else None
        usage = isinstance(options, dict) and options.get("include_usage") is True
        if self.refuse:
            return web.json_response({"error": {"message": "model not found"}}, status=400)
        if usage and self.old:
            error = {"object": "error", "message": "stream_options: extra fields not permitted"}
            return web.json_response(error, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for token in ("a", "b", "c"):
            chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": token}}]}
            if self.nulls or (usage and self.marks):
                chunk["usage"] = None
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if usage or self.forced:
            final = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 1}}
            await response.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[RecordingUpstream], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def start(upstream: RecordingUpstream) -> str:
        runner = web.AppRunner(upstream.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_upstream_receives_the_body_with_the_option_added_and_its_length(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream))
    sent = b'{"model": "m", "stream": true, "stream_options": {"include_usage": false}}'
    async with httpx.AsyncClient() as client:
        responses = [
            await client.post(
                sidecar.proxy_url + CHAT, content=sent, headers={"Content-Type": "application/json"}
            )
            for _ in range(2)
        ]
    expected = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'
    assert upstream.bodies == [sent, expected]  # the first one shows the habit
    assert upstream.lengths == [str(len(sent)), str(len(expected))]
    for response in responses:
        assert b"usage" not in response.content and response.content.count(b"data: ") == 4
    assert (await meter_of(sidecar, 2)).tokens_generated == 3
    assert sidecar.tracker.finished[-1].meter.tokens_source == "provider"


@pytest.mark.parametrize(
    "sent",
    [
        b'not json at all, but asking for a stream: "stream": true',
        b'[{"stream": true}]',  # JSON, not an object
        b'{"stream": true, "stream_options": "odd"}',
    ],
    ids=["not-json", "not-an-object", "odd-stream-options"],
)
async def test_bodies_it_cannot_rewrite_go_unchanged(
    serve: Callable[[RecordingUpstream], Awaitable[str]],
    start_sidecar: StartSidecar,
    sent: bytes,
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream))
    async with httpx.AsyncClient() as client:
        await client.post(sidecar.proxy_url + CHAT, content=sent)
    assert upstream.bodies == [sent]


async def test_a_body_over_the_bound_goes_unchanged_and_whole(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream()
    sidecar = await start_sidecar(await serve(upstream), usage_injection_max_body_bytes="1KiB")
    big = json.dumps({"stream": True, "messages": [{"content": "x" * 5000}]}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: read to the bound
        for start in range(0, len(big), 700):
            yield big[start : start + 700]

    async with httpx.AsyncClient() as client:
        await client.post(sidecar.proxy_url + CHAT, content=chunked())
        await client.post(sidecar.proxy_url + CHAT, content=big)
    assert upstream.bodies == [big, big]


async def test_an_upstream_that_refuses_the_option_gets_the_request_unchanged_and_is_remembered(
    serve: Callable[[RecordingUpstream], Awaitable[str]], start_sidecar: StartSidecar
) -> None:
    upstream = RecordingUpstream(old=True)
    sidecar = await start_sidecar(await serve(upstream))
    sent = json.dumps(REQUEST).encode()
    async with httpx.AsyncClient() as client:
        answers = [await client.post(sidecar.proxy_url + CHAT, content=sent) for _ in range(3)]
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    assert len({answer.content for answer in answers}) == 1
    assert answers[0].content.endswith(b"data: [DONE]\n\n")
    # Unchanged to learn the habit; then injected once, refused, sent again
    # unchanged; then left alone.
    assert [b"include_usage" in body for body in upstream.bodies] == [False, True, False, False]
    assert upstream.bodies[2:] == [sent, sent]


async def test_another_400_reaches_the_client_as_it_came(
    start_sidecar: StartSidecar, serve: Callable[[RecordingUpstream], Awaitable[str]]
) -> None:
    upstream = RecordingUpstream(refuse=True)
    sidecar = await start_sidecar(await serve(upstream))
    async with httpx.AsyncClient() as client:
        response = await client.post(sidecar.proxy_url + CHAT, json=REQUEST)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "model not found"}}
    assert len(upstream.bodies) == 1  # not sent twice: the option was not the problem


def test_a_usage_only_chunk_without_a_completion_count_is_hidden_too() -> None:
    from streamwarden.core.relay import Limits, Relay
    from streamwarden.core.usage import TakeBack

    relay = Relay(
        Limits(15.0, 60.0, 1800.0, 1 << 20),
        started_at=0.0,
        now=0.0,
        path=CHAT,
        content_type="text/event-stream",
        headers={},
        usage=TakeBack(),
    )
    assert relay.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n', 0.1) == b""
    chunk = b'data: {"choices":[{"delta":{"content":"a"}}],"usage":null}\n\n'
    assert relay.feed(chunk, 0.2) == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'


async def chat_bodies(url: str, count: int) -> list[bytes]:
    async with httpx.AsyncClient() as client:
        return [(await client.post(url + CHAT, json=REQUEST)).content for _ in range(count)]


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
    serve: Callable[[RecordingUpstream], Awaitable[str]],
    start_sidecar: StartSidecar,
    habit: dict[str, bool],
) -> None:
    upstream = RecordingUpstream(**habit)
    url = await serve(upstream)
    (direct,) = await chat_bodies(url, 1)
    sidecar = await start_sidecar(url)
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


KEY = (CHAT, "m", False)


def _frame(raw: bytes) -> Any:
    from streamwarden.core.sse import Event, Frame

    return Frame(raw, Event("message", raw.decode().removeprefix("data: ").strip(), None))


def test_a_habit_is_learned_from_a_whole_stream_and_again_after_its_memory() -> None:
    from streamwarden.core.dialects.base import NOTHING, TERMINAL
    from streamwarden.core.usage import HabitWatch, TakeBack, UsageHabit, UsageHabits

    habits = UsageHabits(memory=60.0, paths=2)
    watch = habits.role(KEY, 0.0)
    assert isinstance(watch, HabitWatch)
    watch.see(_frame(b'data: {"choices":[],"usage":null}\n\n'), NOTHING, 1.0)
    assert isinstance(habits.role(KEY, 1.0), HabitWatch)  # not yet known
    watch.see(_frame(b"data: [DONE]\n\n"), TERMINAL, 2.0)  # whole, with nulls, no count
    assert habits.role(KEY, 3.0) == TakeBack(chunk=True, nulls=False)
    assert isinstance(habits.role(KEY, 62.0), HabitWatch)  # learned again
    # A bounded memory: a third key forgets the oldest.
    habits.learn(("/a", "m", False), UsageHabit(volunteers=True, marks_null=False), 3.0)
    habits.learn(("/b", "m", False), UsageHabit(volunteers=False, marks_null=False), 3.0)
    assert isinstance(habits.role(KEY, 4.0), HabitWatch)
    assert habits.role(("/a", "m", False), 4.0) is None  # volunteers: nothing to inject
    assert habits.role(("/b", "m", False), 4.0) == TakeBack()


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
    assert isinstance(habits.role((CHAT, "other", False), 2.0), HabitWatch)


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
        (b'{"model":"m","stream":true,"stream_options":{"include_usage":false}}', True),
        # vLLM's continuous_usage_stats would put a count on every chunk.
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
        assert json.loads(asked.injected)["stream_options"]["include_usage"] is True
        assert asked.had_options == (b"stream_options" in body)


async def test_a_stream_cut_before_its_end_teaches_no_habit(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    async with httpx.AsyncClient() as client:
        headers = {**MOCK, "x-mock-fault": "truncate"}
        await client.post(sidecar.proxy_url + CHAT, json=REQUEST, headers=headers)
    await raw_stream(sidecar.proxy_url, REQUEST, "after-the-cut")
    await wait_for(lambda: len(sidecar.tracker.finished) == 2)
    # Both went unchanged: a truncated stream shows nothing of what comes at the end.
    assert [r.meter.tokens_source for r in sidecar.tracker.finished] == ["estimated"] * 2
