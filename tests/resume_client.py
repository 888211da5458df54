"""A client of a resumable route: read a stream, drop it, ask again with its last event id.

Against the mock upstream (``x-mock-*`` controls) through a sidecar, or
against an app behind the middleware: the resume tests of both faces, and
those across replicas, share it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import aiohttp

from streamwarden.core.sse import Event, SSEDecoder
from streamwarden.features.resume.model import STREAM_ID_HEADER

CHAT = "/v1/chat/completions"
TOKENS = 60
KEY = {"Authorization": "Bearer sk-owner"}


def mock_headers(request_id: str, tps: int = 100, tokens: int = TOKENS) -> dict[str, str]:
    return {
        "x-mock-tps": str(tps),
        "x-mock-ttft": "0",
        "x-mock-tokens": str(tokens),
        "x-mock-request-id": request_id,
        **KEY,
    }


def text_of(events: list[Event]) -> str:
    """The answer text of OpenAI chat chunks (the role chunk and [DONE] carry none)."""
    text = ""
    for event in events:
        if event.data == "[DONE]":
            continue
        for choice in json.loads(event.data).get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text


async def read_events(
    response: aiohttp.ClientResponse, *, until: Callable[[list[Event]], bool] | None = None
) -> list[Event]:
    """Events of a response, to its end or until ``until`` holds."""
    decoder = SSEDecoder()
    events: list[Event] = []
    async for chunk in response.content.iter_any():
        events.extend(decoder.feed(chunk))
        if until is not None and until(events):
            return events
    events.extend(decoder.close())
    return events


async def cut_after(
    url: str, request_id: str, count: int, *, tps: int = 100, tokens: int = TOKENS, **extra: str
) -> tuple[str, list[Event]]:
    """Start a stream, read ``count`` events, then drop the connection."""
    headers = {**mock_headers(request_id, tps=tps, tokens=tokens), **extra}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=headers, json={"stream": True}) as response:
            stream_id = response.headers.get(STREAM_ID_HEADER, "")
            events = await read_events(response, until=lambda got: len(got) >= count)
            response.close()  # the connection drops mid-answer
    return stream_id, events


async def resume(
    url: str, last_event_id: str, *, headers: dict[str, str] | None = None, query: bool = False
) -> tuple[int, dict[str, str], list[Event], bytes]:
    """Ask again with the last event id (header, as EventSource does, or query)."""
    sent = dict(KEY if headers is None else headers)
    target = url + CHAT
    if query:
        target += f"?last_event_id={last_event_id}"
    else:
        sent["Last-Event-ID"] = last_event_id
    async with aiohttp.ClientSession() as session:
        async with session.post(target, headers=sent, json={"stream": True}) as response:
            body = await response.read()
            decoder = SSEDecoder()
            events = decoder.feed(body) + decoder.close()
            return response.status, dict(response.headers), events, body
