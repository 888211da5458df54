"""Cut a resumable stream at every event, resume it, and compare with the stream read whole.

A resume must hand a client exactly the events it has not seen: as many as
the stream has after its position, each the bytes the client would have got
had it stayed. The check needs a stream that is the same bytes every time:
the mock with a fixed request id (its ``created`` field is the wall-clock
second, so it is written as 0 on both sides), or :class:`ScriptedChat`, an
OpenAI chat upstream that writes one event per write, a few milliseconds
apart, so that a cut can land between any two events: between the usage
chunk and ``[DONE]`` too, which the mock writes back to back.

:func:`cut_everywhere` reads the stream whole once, then, for every cut
point at once, opens it, reads that many events, drops the connection and
resumes (on another replica, with Redis), and returns the pieces to
compare. An event is compared as its raw block, ``id`` line included: the
stream id is written as ``S``, the sequence number is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from streamwarden.core.sse import SSEFramer
from streamwarden.features.resume.model import STREAM_ID_HEADER
from upstreams import serving

__all__ = [
    "SHAPES",
    "Cut",
    "ScriptedChat",
    "assert_exact",
    "chat_body",
    "cut_everywhere",
    "event_blocks",
    "scripted_chat",
]

_CREATED = re.compile(rb'"created":\d+')
PIECES = ("Hel", "lo", " 日本", "語")
#: Seconds between two events of the scripted upstream.
PACE = 0.004


def event_blocks(raw: bytes, stream_id: str) -> list[bytes]:
    """The event blocks of a response as received (comments and keep-alives aside)."""
    frames = SSEFramer().feed(raw)
    marker = stream_id.encode() if stream_id else b"\0"
    return [
        _CREATED.sub(b'"created":0', frame.raw.replace(marker, b"S"))
        for frame in frames
        if frame.event is not None
    ]


def _chunk(choices: list[dict[str, Any]], *, nulls: bool, usage: bool = False) -> bytes:
    data: dict[str, Any] = {
        "id": "chatcmpl-resume",
        "object": "chat.completion.chunk",
        "created": 1757435012,
        "model": "m",
        "choices": choices,
    }
    if usage:
        data["usage"] = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    elif nulls:
        data["usage"] = None
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _chat(asked: bool, *, usage: bool, done: bool) -> list[bytes]:
    def delta(content: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}

    events = [_chunk([delta({"role": "assistant", "content": ""})], nulls=asked)]
    events += [_chunk([delta({"content": piece})], nulls=asked) for piece in PIECES]
    events.append(_chunk([delta({}, "stop")], nulls=asked))
    if usage:
        events.append(_chunk([], nulls=asked, usage=True))
    if done:
        events.append(b"data: [DONE]")
    return [event + b"\n\n" for event in events]


def _openai(asked: bool) -> list[bytes]:
    # OpenAI's habit: "usage": null on every chunk and the usage chunk, only when asked.
    return _chat(asked, usage=asked, done=True)


def _upstream_ids(asked: bool) -> list[bytes]:
    # Its own ids on every event, and one block that sets an id and dispatches nothing.
    blocks = [b"id: up-%d\n" % n + block for n, block in enumerate(_openai(asked), 1)]
    blocks.insert(-1, b"id: up-x\n\n")
    return blocks


def _forced_usage(asked: bool) -> list[bytes]:
    # vLLM --enable-force-include-usage: the usage chunk whether asked or not.
    return _chat(asked, usage=True, done=True)


def _ends_with_usage(asked: bool) -> list[bytes]:
    # A server that always counts, and whose stream ends with the usage chunk (no [DONE]).
    return _chat(asked, usage=True, done=False)


#: The scripted upstream's answers, by the first segment of the request path.
SHAPES = {
    "chat": _openai,
    "upstream-ids": _upstream_ids,
    "forced-usage": _forced_usage,
    "ends-with-usage": _ends_with_usage,
}


class ScriptedChat:
    """An OpenAI chat upstream answering ``/<shape>/v1/chat/completions``, one event per write."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.app.router.add_post("/{shape}/v1/chat/completions", self.answer)

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        options = body.get("stream_options")
        asked = isinstance(options, dict) and options.get("include_usage") is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for block in SHAPES[request.match_info["shape"]](asked):
            await response.write(block)
            await asyncio.sleep(PACE)  # the model's pace: a cut may land after any event
        await response.write_eof()
        return response


def scripted_chat() -> contextlib.AbstractAsyncContextManager[str]:
    """A :class:`ScriptedChat` on a free loopback port: its base URL."""
    return serving(ScriptedChat().app)


def chat_body(asks_usage: bool) -> dict[str, Any]:
    """A streaming chat request, asking for usage itself or not."""
    body: dict[str, Any] = {"model": "m", "stream": True, "messages": []}
    if asks_usage:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass(frozen=True, slots=True)
class Cut:
    """One cut: the events its client got before the drop, and what its resume got."""

    seen: list[bytes]
    resumed: list[bytes]
    status: int


async def _read_whole(url: str, headers: Mapping[str, str], body: dict[str, Any]) -> list[bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=headers, json=body) as response:
            return event_blocks(await response.read(), response.headers.get(STREAM_ID_HEADER, ""))


_ID_LINE = re.compile(rb"^id:[^\n]*\n", re.MULTILINE)


async def read_direct(url: str, headers: Mapping[str, str], body: dict[str, Any]) -> list[bytes]:
    """The event blocks a client gets with no sidecar, without their ``id`` lines."""
    return [_ID_LINE.sub(b"", block) for block in await _read_whole(url, headers, body)]


def assert_as_direct(whole: list[bytes], direct: list[bytes]) -> None:
    """The stream through a resumable route is the direct one, but for its own ids.

    (An error event after the direct events is the one documented addition
    a stream that ends without its terminal event gets.)
    """
    ours = [_ID_LINE.sub(b"", block) for block in whole]
    assert ours[: len(direct)] == direct
    assert all(b'"code":"stream_truncated"' in extra for extra in ours[len(direct) :])


async def _cut(
    url: str,
    resume_url: str,
    headers: Mapping[str, str],
    body: dict[str, Any],
    count: int,
) -> Cut:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=headers, json=body) as response:
            stream_id = response.headers[STREAM_ID_HEADER]
            received = b""
            seen: list[bytes] = []
            async for chunk in response.content.iter_any():
                received += chunk
                seen = event_blocks(received, stream_id)
                if len(seen) >= count:
                    break
            response.close()  # the connection drops
    # What the client got is all it knows: its last event's id is its position.
    (last,) = re.findall(rb"id: S\.(\d+)\n\n$", seen[-1])
    asked = {**headers, "Last-Event-ID": f"{stream_id}.{last.decode()}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(resume_url, headers=asked, json=body) as again:
            resumed = event_blocks(await again.read(), stream_id)
            return Cut(seen, resumed, again.status)


async def cut_everywhere(
    url: str,
    headers: Mapping[str, str],
    body: dict[str, Any],
    *,
    resume_url: str | None = None,
) -> tuple[list[bytes], list[Cut]]:
    """The stream read whole, and a cut (then a resume) after each of its events but the last.

    ``resume_url``: resume there (another replica), at once: a stream whose
    client has its id is in the store that every replica asks.
    """
    whole = await _read_whole(url, headers, body)
    cuts = await asyncio.gather(
        *(_cut(url, resume_url or url, headers, body, n) for n in range(1, len(whole)))
    )
    return whole, list(cuts)


def assert_exact(whole: list[bytes], cuts: list[Cut]) -> None:
    """Every cut's client got, across its drop, exactly the stream read whole."""
    for cut in cuts:
        after = len(cut.seen)
        assert cut.status == (204 if after == len(whole) else 200)
        assert len(cut.resumed) == len(whole) - after, (
            f"cut after {after} events: {len(cut.resumed)} resumed, not {len(whole) - after}"
        )
        assert cut.seen + cut.resumed == whole, f"cut after {after} events"
