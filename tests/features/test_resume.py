"""Resumable streams on one replica, with the memory store (``on_client_gone: detach``).

A client whose connection drops mid-answer has two outcomes without
resume: a cancelled generation, or a second one (it asks again and the
model samples a new answer: the user sees text twice). Through a resumable
route it asks again with the last event id it saw and gets exactly the
events it missed, then the rest live, from the one generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from resume_client import CHAT, KEY, TOKENS, cut_after, mock_headers, read_events, resume, text_of
from resume_cuts import (
    SHAPES,
    assert_as_direct,
    assert_exact,
    chat_body,
    cut_everywhere,
    read_direct,
    scripted_chat,
)
from sidecars import StartSidecar
from streamwarden.core.sse import Event, SSEDecoder
from streamwarden.features.resume.model import STREAM_ID_HEADER
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from streamwarden.tools.mock.tokens import mock_text
from upstreams import ServeUpstream
from waiting import wait_for


@pytest.fixture
async def resumable(mock: MockServer, start_sidecar: StartSidecar) -> AsyncIterator[Sidecar]:
    yield await start_sidecar(mock.url, on_client_gone="detach", resume_window="5s")


async def test_without_resume_a_retry_after_a_drop_starts_a_second_generation(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    stream_id, first = await cut_after(sidecar.proxy_url, "once", 10)
    assert stream_id == ""  # a plain route names no stream
    assert all(event.id is None for event in first)
    status, _, again, _ = await resume(sidecar.proxy_url, "whatever.9")
    # Forwarded: the model is asked a second time and the answer starts over.
    assert status == 200
    assert len(mock.stats.records) == 2
    assert text_of(again).startswith(mock_text(3))
    assert text_of(first + again) != mock_text(TOKENS)


@pytest.mark.parametrize("by", ["header", "query"])
async def test_a_dropped_client_resumes_with_exactly_the_missing_events(
    mock: MockServer, resumable: Sidecar, by: str
) -> None:
    stream_id, first = await cut_after(resumable.proxy_url, "resumed", 10)
    assert len(stream_id) == 32
    assert [event.id for event in first] == [f"{stream_id}.{n}" for n in range(1, len(first) + 1)]
    status, headers, rest, _ = await resume(
        resumable.proxy_url, first[-1].id or "", query=by == "query"
    )
    assert status == 200 and headers[STREAM_ID_HEADER] == stream_id
    ids = [event.id for event in first + rest]
    assert ids == [f"{stream_id}.{n}" for n in range(1, len(ids) + 1)]  # each once, in order
    assert rest[-1].data == "[DONE]"
    assert text_of(first + rest) == mock_text(TOKENS)
    assert len(mock.stats.records) == 1  # one generation, never a second
    assert (await mock.stats.wait_ended("resumed")).completed
    await wait_for(lambda: len(resumable.tracker.finished) == 1)
    meter = resumable.tracker.finished[-1].meter
    assert meter.end_state == "completed"
    metrics = resumable.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="ok"} 1.0' in metrics


async def test_a_resume_mid_stream_continues_live_and_holds_a_detached_stream_open(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    # A window far shorter than the rest of the answer: only the resumed
    # client's hold keeps the upstream running past it.
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_window="300ms")
    _, first = await cut_after(sidecar.proxy_url, "slow", 3, tps=20, tokens=30)
    await wait_for(lambda: sidecar.metrics.detached._value.get() == 1, what="detached")
    async with aiohttp.ClientSession() as session:
        async with session.get(
            sidecar.proxy_url + CHAT, headers={**KEY, "Last-Event-ID": first[-1].id or ""}
        ) as again:
            rest = await read_events(again)
    assert text_of(first + rest) == mock_text(30)
    assert (await mock.stats.wait_ended("slow")).completed
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    meter = sidecar.tracker.finished[-1].meter
    assert meter.end_state == "completed"
    assert meter.tokens_zombie == 0  # what its client missed, a resumed client got


async def test_detached_with_nobody_resuming_closes_the_upstream_after_the_window(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_window="200ms")
    await cut_after(sidecar.proxy_url, "abandoned", 3, tps=50, tokens=2000)
    upstream = await mock.stats.wait_ended("abandoned", timeout=10)
    assert upstream.closed_early and upstream.tokens_generated < 2000
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    meter = sidecar.tracker.finished[-1].meter
    assert meter.end_state == "detached_expired"
    assert meter.tokens_zombie > 0  # generated after the client left, for nobody
    assert sidecar.metrics.detached._value.get() == 0


async def test_an_explicit_stop_closes_a_detached_stream_at_once(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_window="60s")
    stream_id, _ = await cut_after(sidecar.proxy_url, "stopped", 2, tps=20, tokens=2000)
    await wait_for(lambda: sidecar.metrics.detached._value.get() == 1, what="detached")
    async with aiohttp.ClientSession() as session:
        async with session.delete(
            sidecar.proxy_url + CHAT,
            headers={"Authorization": "Bearer sk-other", STREAM_ID_HEADER: stream_id},
        ) as refused:
            assert refused.status == 404  # not the owner: as if there were no such stream
        async with session.delete(
            sidecar.proxy_url + CHAT, headers={**KEY, STREAM_ID_HEADER: stream_id}
        ) as stopped:
            assert stopped.status == 204
    upstream = await mock.stats.wait_ended("stopped")
    assert upstream.closed_early
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    assert sidecar.tracker.finished[-1].meter.end_state == "client_cancelled"


@pytest.mark.parametrize("asks_usage", [False, True], ids=["plain", "asks-usage"])
async def test_a_resume_after_any_event_gets_exactly_the_events_not_seen(
    mock: MockServer, resumable: Sidecar, asks_usage: bool
) -> None:
    # The mock with the default usage_injection: the sidecar may ask it for
    # usage the client did not ask for, and takes back what that adds (the
    # usage chunk, "usage": null), from the journal as from the live stream:
    # an upstream sends one event more than such a client is ever handed.
    headers = mock_headers("exact", tps=200, tokens=8)
    direct = await read_direct(mock.url + CHAT, headers, chat_body(asks_usage))
    whole, cuts = await cut_everywhere(resumable.proxy_url + CHAT, headers, chat_body(asks_usage))
    assert_as_direct(whole, direct)
    assert len(whole) == 11 + asks_usage and whole[-1].startswith(b"data: [DONE]\n")
    assert sum(b'"choices":[]' in event for event in whole) == asks_usage
    assert any(b'"usage":null' in event for event in whole) == asks_usage
    assert_exact(whole, cuts)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("asks_usage", [False, True], ids=["plain", "asks-usage"])
async def test_a_resume_gets_exactly_the_events_not_seen_whatever_the_upstream_ends_with(
    start_sidecar: StartSidecar, shape: str, asks_usage: bool
) -> None:
    async with scripted_chat() as upstream:
        sidecar = await start_sidecar(upstream, on_client_gone="detach", resume_window="5s")
        direct = await read_direct(f"{upstream}/{shape}{CHAT}", KEY, chat_body(asks_usage))
        url = f"{sidecar.proxy_url}/{shape}{CHAT}"
        whole, cuts = await cut_everywhere(url, KEY, chat_body(asks_usage))
    assert all(b"up-" not in event for event in whole)  # the sidecar owns the id field
    assert_as_direct(whole, direct)  # a usage chunk of the upstream's own included
    assert_exact(whole, cuts)


async def test_a_resume_with_other_credentials_is_told_what_an_unknown_stream_is_told(
    mock: MockServer, resumable: Sidecar
) -> None:
    _, first = await cut_after(resumable.proxy_url, "owned", 5)
    position = first[-1].id or ""
    _, _, _, stranger = await resume(
        resumable.proxy_url, position, headers={"Authorization": "Bearer sk-stranger"}
    )
    _, _, _, unknown = await resume(resumable.proxy_url, "0" * 32 + ".5")
    _, _, _, no_key = await resume(resumable.proxy_url, position, headers={})
    assert stranger == unknown == no_key
    assert b"resume_expired" in stranger
    assert len(mock.stats.records) == 1  # never forwarded
    metrics = resumable.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="denied"} 2.0' in metrics
    assert 'streamwarden_resumes_total{result="expired"} 1.0' in metrics
    # The owner still can.
    _, _, rest, _ = await resume(resumable.proxy_url, position)
    assert text_of(first + rest) == mock_text(TOKENS)


async def test_a_resume_whose_position_was_evicted_gets_resume_gap(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_max_bytes="2KiB")
    stream_id, first = await cut_after(sidecar.proxy_url, "evicted", 2)
    await mock.stats.wait_ended("evicted")
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    _, _, events, body = await resume(sidecar.proxy_url, first[-1].id or "")
    assert b"resume_gap" in body and len(events) == 1
    # The newest events are still there.
    stored = sidecar.proxy.resume.backend.store.find(stream_id)  # type: ignore[union-attr, attr-defined]
    assert stored is not None and stored.first_seq > 3
    _, _, tail, _ = await resume(sidecar.proxy_url, f"{stream_id}.{stored.first_seq - 1}")
    assert tail[-1].data == "[DONE]"


async def test_a_resume_after_the_end_gets_204_so_eventsource_stops(
    mock: MockServer, resumable: Sidecar
) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            resumable.proxy_url + CHAT, headers=mock_headers("whole"), json={"stream": True}
        ) as response:
            events = await read_events(response)
    assert events[-1].data == "[DONE]"
    status, _, _, body = await resume(resumable.proxy_url, events[-1].id or "")
    assert status == 204 and body == b""


async def test_a_resumed_stream_ends_the_way_the_original_ended(
    mock: MockServer, resumable: Sidecar
) -> None:
    async with aiohttp.ClientSession() as session:
        headers = {**mock_headers("cut"), "x-mock-fault": "truncate", "x-mock-fault-after": "20"}
        async with session.post(
            resumable.proxy_url + CHAT, headers=headers, json={"stream": True}
        ) as response:
            first = await read_events(response, until=lambda got: len(got) >= 3)
            response.close()
    await mock.stats.wait_ended("cut")
    await wait_for(lambda: len(resumable.tracker.finished) == 1)
    assert resumable.tracker.finished[-1].meter.end_state == "upstream_truncated"
    _, _, rest, _ = await resume(resumable.proxy_url, first[-1].id or "")
    assert "stream_truncated" in rest[-1].data
    assert text_of(first + rest[:-1]) == mock_text(20)


async def upstream_with_its_own_ids(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = '{"choices":[{"delta":{"content":"%s"}}]}'
    await response.write(b"id: up-1\ndata: " + (chunk % "a").encode() + b"\n\n")
    await response.write(b"id\r\ndata: " + (chunk % "b").encode() + b"\r\n\r\n")
    await response.write(b"id: up-3\n\n")  # dispatches nothing, but would set the id
    await response.write(b"data: [DONE]\nid: up-4\n\n")
    await response.write_eof()
    return response


async def test_the_sidecar_owns_the_id_field_on_a_resumable_route(
    start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    app = web.Application()
    app.router.add_post(CHAT, upstream_with_its_own_ids)
    sidecar = await start_sidecar(await serve_upstream(app), on_client_gone="detach")
    async with httpx.AsyncClient() as client:
        response = await client.post(sidecar.proxy_url + CHAT, json={"stream": True})
    stream_id = response.headers[STREAM_ID_HEADER]
    decoder = SSEDecoder()
    events = decoder.feed(response.content) + decoder.close()
    assert [e.id for e in events] == [f"{stream_id}.{n}" for n in (1, 2, 3)]
    assert b"up-" not in response.content
    assert text_of(events) == "ab"


@pytest.mark.parametrize("code", ["resume_expired", "resume_gap"])
async def test_the_official_sdks_raise_on_resume_errors(
    mock: MockServer, start_sidecar: StartSidecar, code: str
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_max_bytes="2KiB")
    _, first = await cut_after(sidecar.proxy_url, "sdk", 2)
    await mock.stats.wait_ended("sdk")
    position = first[-1].id if code == "resume_gap" else "f" * 32 + ".1"
    openai_client = openai.AsyncOpenAI(
        base_url=sidecar.proxy_url + "/v1", api_key="sk-owner", max_retries=0
    )
    with pytest.raises(openai.APIError, match=code):
        stream = await openai_client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers={"Last-Event-ID": position or ""},
        )
        async for _ in stream:
            pass
    await openai_client.close()
    # anthropic's SDK on its own path, same store and rule.
    anthropic_client = anthropic.AsyncAnthropic(
        base_url=sidecar.proxy_url, api_key="k", max_retries=0
    )
    with pytest.raises(anthropic.APIStatusError, match="resume_expired"):
        async with anthropic_client.messages.stream(
            model="m",
            max_tokens=10,
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"Last-Event-ID": "e" * 32 + ".1"},
        ) as events:
            async for _ in events:
                pass
    await anthropic_client.close()
    assert len(mock.stats.records) == 1


async def test_a_stream_closed_for_want_of_a_resume_tells_a_late_resume_so(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, on_client_gone="detach", resume_window="200ms")
    stream_id, first = await cut_after(sidecar.proxy_url, "late", 3, tps=50, tokens=2000)
    await mock.stats.wait_ended("late", timeout=10)
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    assert sidecar.tracker.finished[-1].meter.end_state == "detached_expired"
    _, _, rest, _ = await resume(sidecar.proxy_url, first[-1].id or "")
    # The events it missed, then an error it raises on: never a cut answer as if whole.
    assert rest and "resume_expired" in rest[-1].data and "resume_window" in rest[-1].data
    assert all(e.id.startswith(stream_id) for e in rest if e.id)


#: Positions with digits of other scripts (``int`` and ``str.isdigit`` take
#: them), too many digits, or foreign letters: each names no stream of ours.
HOSTILE_SEQS = ["\u00b2", "\u0663", "\uff11", "1" * 19, "+1", "1_0"]


@pytest.mark.parametrize("seq", HOSTILE_SEQS, ids=ascii)
@pytest.mark.parametrize("by", ["header", "query"])
async def test_a_position_that_is_not_ascii_digits_is_an_unknown_stream_never_a_500(
    mock: MockServer, resumable: Sidecar, seq: str, by: str
) -> None:
    stream_id, first = await cut_after(resumable.proxy_url, "hostile-id", 3)
    asked = f"{stream_id}.{seq}"
    async with httpx.AsyncClient() as client:
        # As UTF-8: the bytes a client's library sends for such a string.
        if by == "header":
            sent = {**KEY, "Last-Event-ID": asked.encode()}
            response = await client.post(resumable.proxy_url + CHAT, headers=sent, json={})
        else:
            response = await client.post(
                resumable.proxy_url + CHAT, params={"last_event_id": asked}, headers=KEY, json={}
            )
    assert response.status_code == 200
    assert b"resume_expired" in response.content
    assert len(mock.stats.records) == 1  # a resume: never forwarded
    metrics = resumable.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="expired"} 1.0' in metrics
    # The stream itself is untouched: its owner resumes it.
    _, _, rest, _ = await resume(resumable.proxy_url, first[-1].id or "")
    assert text_of(first + rest) == mock_text(TOKENS)


GEMINI = "/v1beta/models/m:streamGenerateContent"


def gemini_text(events: list[Event]) -> str:
    import json

    text = ""
    for event in events:
        for candidate in json.loads(event.data).get("candidates", []):
            text += "".join(part.get("text", "") for part in candidate["content"]["parts"])
    return text


@contextlib.asynccontextmanager
async def gemini_post(
    url: str, key: str, where: str, *, last_event_id: str | None = None
) -> AsyncIterator[aiohttp.ClientResponse]:
    """A Gemini request carrying its key where Google's clients put it."""
    headers = {"x-mock-tps": "100", "x-mock-ttft": "0", "x-mock-tokens": str(TOKENS)}
    target = f"{url}{GEMINI}?alt=sse"
    if where == "header":
        headers["x-goog-api-key"] = key  # google-genai
    else:
        target += f"&key={key}"  # Google's REST examples, older SDKs
    if last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(target, headers=headers, json=body) as response:
            yield response


async def gemini_resume(url: str, key: str, where: str, position: str) -> bytes:
    async with gemini_post(url, key, where, last_event_id=position) as response:
        return await response.read()


@pytest.mark.parametrize("where", ["header", "query"])
async def test_a_gemini_stream_resumes_only_with_the_key_it_was_asked_with(
    mock: MockServer, resumable: Sidecar, where: str
) -> None:
    async with gemini_post(resumable.proxy_url, "AIza-owner", where) as response:
        stream_id = response.headers[STREAM_ID_HEADER]
        first = await read_events(response, until=lambda got: len(got) >= 3)
        response.close()  # the connection drops mid-answer
    position = first[-1].id or ""
    assert position.startswith(stream_id)
    # Another key: told exactly what a stream that never existed is told.
    stranger = await gemini_resume(resumable.proxy_url, "AIza-stranger", where, position)
    unknown = await gemini_resume(resumable.proxy_url, "AIza-owner", where, "0" * 32 + ".3")
    assert stranger == unknown and b"resume_expired" in stranger
    metrics = resumable.metrics.render().decode()
    assert 'streamwarden_resumes_total{result="denied"} 1.0' in metrics
    # The owner's key resumes it: the one generation, each event once.
    owner = await gemini_resume(resumable.proxy_url, "AIza-owner", where, position)
    decoder = SSEDecoder()
    rest = decoder.feed(owner) + decoder.close()
    assert gemini_text(first + rest) == mock_text(TOKENS)
    assert len(mock.stats.records) == 1
