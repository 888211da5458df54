"""Resumable streams in the middleware: the same keys, the app's generator as the upstream.

``on_client_gone: detach`` keeps the app's generator running after its
client left, its events kept for a resume; a request with ``Last-Event-ID``
is answered from the store and never reaches the app. ``drain`` runs the
generator to its end, writing nothing. Served by uvicorn, in process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import pytest

from paced_model import TOKENS, Model, served
from resume_client import KEY, read_events, text_of
from streamwarden.core.lifecycle import Phase
from streamwarden.core.sse import SSEDecoder
from streamwarden.features.resume.model import STREAM_ID_HEADER
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock.tokens import mock_tokens
from waiting import wait_for

CHAT = "/v1/chat/completions"


async def cut(url: str, count: int) -> tuple[str, list[Any]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=KEY, json={"stream": True}) as response:
            stream_id = response.headers.get(STREAM_ID_HEADER, "")
            events = await read_events(response, until=lambda got: len(got) >= count)
            response.close()
    return stream_id, events


async def test_without_resume_a_retry_runs_the_generator_again() -> None:
    model = Model()
    async with served(model) as (url, _):
        _, first = await cut(url, 5)
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + CHAT, headers={**KEY, "Last-Event-ID": "x.5"}, json={"stream": True}
            ) as again:
                rest = await read_events(again)
    assert model.generations == 2
    assert text_of(first + rest) != "".join(mock_tokens(TOKENS))


@pytest.mark.parametrize("gzipped", [False, True], ids=["identity", "gzip"])
async def test_a_dropped_client_resumes_and_the_app_ran_once(gzipped: bool) -> None:
    # The resume must come within the window (a busy CI machine took over
    # 200 ms once) and the rest of the answer must outlast it: 35 events at
    # 80 ms are 2.8 s against a 1 s window.
    model = Model(pace=0.08, gzipped=gzipped)
    async with served(model, on_client_gone="detach", resume_window="1s") as (url, mw):
        stream_id, first = await cut(url, 5)
        assert len(stream_id) == 32
        await wait_for(lambda: mw.metrics.detached._value.get() == 1, what="detached")
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + CHAT,
                headers={**KEY, "Last-Event-ID": first[-1].id or ""},
                json={"stream": True},
            ) as again:
                assert again.headers[STREAM_ID_HEADER] == stream_id
                rest = await read_events(again)
        await wait_for(lambda: len(mw.streams.finished) == 1)
        meter = mw.streams.finished[-1].meter
    assert model.generations == 1  # the resume never reached the app
    assert rest[-1].data == "[DONE]"
    ids = [e.id for e in first + rest]
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]
    assert text_of(first + rest) == "".join(mock_tokens(TOKENS))
    assert meter.end_state == "completed"  # held past its 1 s window by the resume


async def test_detached_with_nobody_resuming_stops_the_app_after_the_window() -> None:
    model = Model(pace=0.05)
    async with served(model, on_client_gone="detach", resume_window="150ms") as (url, mw):
        await cut(url, 3)
        await asyncio.wait_for(model.finished.wait(), 10)
        await wait_for(lambda: len(mw.streams.finished) == 1)
        meter = mw.streams.finished[-1].meter
    assert model.tokens_made < TOKENS  # the generator was cancelled
    assert meter.end_state == "detached_expired"
    assert meter.tokens_zombie > 0


async def test_drain_runs_the_app_to_its_end_for_a_client_that_left() -> None:
    model = Model()
    async with served(model, on_client_gone="drain") as (url, mw):
        await cut(url, 2)
        await asyncio.wait_for(model.finished.wait(), 10)
        await wait_for(lambda: len(mw.streams.finished) == 1)
        meter = mw.streams.finished[-1].meter
    assert model.tokens_made == TOKENS
    assert meter.end_state == "drained"
    assert meter.tokens_zombie > 0


async def refused_or_streamed(url: str) -> str:
    """A new stream's fate: ``"streamed"`` (read to its end) or the refusal's code."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=KEY, json={"stream": True}) as response:
            if response.status != 200:
                code: str = (await response.json())["error"]["code"]
                return code
            await read_events(response)
            return "streamed"


def running_on(mw: StreamWardenMiddleware, phase: Phase) -> bool:
    """Whether the one stream in flight runs on, its client gone, in ``phase``."""
    # The register holds each stream's responder; its relay says where the stream is.
    responders: set[Any] = mw.streams.active
    return any(r._flow.relay.lifecycle.phase is phase for r in responders)


async def test_a_detached_app_keeps_its_slot_and_its_resume_shares_it() -> None:
    model = Model(pace=0.05)
    options = {"on_client_gone": "detach", "resume_window": "5m", "max_concurrent_streams": 1}
    async with served(model, **options) as (url, mw):
        stream_id, first = await cut(url, 3)
        await wait_for(lambda: mw.metrics.detached._value.get() == 1, what="detached")
        # The app runs on for nobody: it still fills the one slot...
        assert await refused_or_streamed(url) == "too_many_streams"
        assert model.generations == 1
        # ...which its owner's resume shares: one generation, one slot.
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + CHAT,
                headers={**KEY, "Last-Event-ID": first[-1].id or ""},
                json={"stream": True},
            ) as again:
                assert again.status == 200 and again.headers[STREAM_ID_HEADER] == stream_id
                rest = await read_events(again)
        await wait_for(lambda: not mw.streams.active, what="the app's end")
        assert await refused_or_streamed(url) == "streamed"  # over: the slot is back
    assert text_of(first + rest) == "".join(mock_tokens(TOKENS))


async def test_a_resume_of_a_stream_over_takes_a_slot_of_its_own() -> None:
    model = Model(pace=0.01)
    options = {"on_client_gone": "detach", "resume_window": "5m", "max_concurrent_streams": 1}
    async with served(model, **options) as (url, mw):
        stream_id, first = await cut(url, 3)
        await asyncio.wait_for(model.finished.wait(), 30)
        await wait_for(lambda: not mw.streams.active, what="the stream's end")
        resume = {**KEY, "Last-Event-ID": first[-1].id or ""}
        async with aiohttp.ClientSession() as session:
            # Another client's live stream holds the one slot...
            async with session.post(url + CHAT, headers=KEY, json={"stream": True}) as live:
                await read_events(live, until=lambda got: len(got) >= 1)
                # ...so a resume of a stream over is refused like any other stream.
                async with session.post(url + CHAT, headers=resume, json={}) as refused:
                    assert refused.status == 503
                    assert (await refused.json())["error"]["code"] == "too_many_streams"
                await read_events(live)  # to its end: its slot goes back
            async with session.post(url + CHAT, headers=resume, json={}) as again:
                assert again.status == 200 and again.headers[STREAM_ID_HEADER] == stream_id
                rest = await read_events(again)
    assert text_of(first + rest) == "".join(mock_tokens(TOKENS))


async def test_an_app_drained_for_a_client_that_left_keeps_its_slot_until_it_ends() -> None:
    model = Model(pace=0.05)  # 2 s of drain: far longer than a refusal takes
    async with served(model, on_client_gone="drain", max_concurrent_streams=1) as (url, mw):
        await cut(url, 3)
        await wait_for(lambda: running_on(mw, Phase.DRAINING), what="drained on")
        assert await refused_or_streamed(url) == "too_many_streams"
        await asyncio.wait_for(model.finished.wait(), 30)
        await wait_for(lambda: len(mw.streams.finished) == 1, what="the drain's end")
        assert mw.streams.finished[-1].meter.end_state == "drained"
        assert await refused_or_streamed(url) == "streamed"  # over: the slot is back
    assert model.generations == 2


@pytest.mark.parametrize(
    ("by", "seq"),
    [("header", "\u00b2"), ("header", "\u00b9"), ("query", "\u00b2"), ("query", "\u0663")],
    ids=ascii,
)
async def test_a_position_that_is_not_ascii_digits_is_an_unknown_stream_never_a_500(
    by: str, seq: str
) -> None:
    model = Model(pace=0.02)
    async with served(model, on_client_gone="detach", resume_window="5s") as (url, _):
        stream_id, first = await cut(url, 3)
        asked = f"{stream_id}.{seq}"
        async with httpx.AsyncClient() as client:
            if by == "header":
                # One byte each: ASGI servers hand header bytes on, read as latin-1.
                sent = {**KEY, "Last-Event-ID": asked.encode("latin-1")}
                response = await client.post(url + CHAT, headers=sent, json={})
            else:
                query = {"last_event_id": asked}
                response = await client.post(url + CHAT, params=query, headers=KEY, json={})
        assert response.status_code == 200
        assert b"resume_expired" in response.content
        assert model.generations == 1  # a resume: never reached the app
        # The stream itself is untouched: its owner resumes it.
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + CHAT,
                headers={**KEY, "Last-Event-ID": first[-1].id or ""},
                json={"stream": True},
            ) as again:
                rest = await read_events(again)
    assert text_of(first + rest) == "".join(mock_tokens(TOKENS))


@pytest.mark.parametrize("where", ["header", "query"])
async def test_a_stream_resumes_only_with_the_gemini_key_it_was_asked_with(where: str) -> None:
    def keyed(key: str) -> tuple[dict[str, str], str]:
        if where == "header":
            return {"x-goog-api-key": key}, ""  # google-genai
        return {}, f"?key={key}"  # Google's REST examples, older SDKs

    model = Model(pace=0.02)
    async with served(model, on_client_gone="detach", resume_window="5s") as (url, mw):
        headers, query = keyed("AIza-owner")
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + CHAT + query, headers=headers, json={"stream": True}
            ) as response:
                stream_id = response.headers[STREAM_ID_HEADER]
                first = await read_events(response, until=lambda got: len(got) >= 3)
                response.close()

            async def resume_with(key: str, position: str) -> bytes:
                headers, query = keyed(key)
                async with session.post(
                    url + CHAT + query,
                    headers={**headers, "Last-Event-ID": position},
                    json={"stream": True},
                ) as again:
                    return await again.read()

            position = first[-1].id or ""
            stranger = await resume_with("AIza-stranger", position)
            unknown = await resume_with("AIza-owner", "0" * 32 + ".3")
            assert stranger == unknown and b"resume_expired" in stranger
            owner = await resume_with("AIza-owner", position)
        assert mw.metrics is not None
        metrics = mw.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="denied"} 1.0' in metrics
    decoder = SSEDecoder()
    rest = decoder.feed(owner) + decoder.close()
    assert all(event.id and event.id.startswith(stream_id) for event in rest)
    assert text_of(first + rest) == "".join(mock_tokens(TOKENS))
    assert model.generations == 1
