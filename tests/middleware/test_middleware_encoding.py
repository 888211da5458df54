"""A compressed event stream from the app: inflated and relayed, as the sidecar does.

Both faces take one decision (``streamwarden.core.plan``): a gzip or deflate
stream is inflated a bounded step at a time and leaves uncompressed, with
``Content-Encoding`` dropped, so its events are framed, kept alive and
ended honestly like any other. Before, the middleware passed it through
compressed: no keep-alive could be placed, no truncation seen, and a
compressor between model and person batched the bytes.
"""

from __future__ import annotations

import zlib
from typing import Any

import httpx
import pytest

from broken import read_broken
from middleware_apps import serve_in_process
from streamwarden.core.sse import SSEDecoder
from streamwarden.middleware import StreamWardenMiddleware


def compressed_stream_app(encoding: str, body: bytes, *, cut: bool = False) -> Any:
    """A raw ASGI app that answers with ``body`` compressed, in several messages."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    compressor = zlib.compressobj(6, zlib.DEFLATED, wbits)
    # A cut stream: everything so far, but never the end of the compressed data.
    packed = compressor.compress(body) + compressor.flush(
        zlib.Z_SYNC_FLUSH if cut else zlib.Z_FINISH
    )

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"content-encoding", encoding.encode()),
                ],
            }
        )
        for at in range(0, len(packed), 7):
            await send(
                {"type": "http.response.body", "body": packed[at : at + 7], "more_body": True}
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


EVENTS = b"".join(b"data: token %d\n\n" % i for i in range(50))


class Raw:
    """A response's headers and its body bytes as they came over the wire (not decoded)."""

    def __init__(self, headers: httpx.Headers, content: bytes) -> None:
        self.headers = headers
        self.content = content


async def raw_get(url: str) -> Raw:
    # What a hop in between sees: the bytes on the wire, nothing decoded.
    async with httpx.AsyncClient() as client:
        async with client.stream("GET", url + "/v1/stream") as response:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
            return Raw(response.headers, body)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_stream_leaves_inflated_and_framed(encoding: str) -> None:
    async with serve_in_process(compressed_stream_app(encoding, EVENTS)) as plain:
        direct = await raw_get(plain)
    assert direct.headers["content-encoding"] == encoding
    assert b"data: token" not in direct.content  # compressed bytes, no events to frame

    app = StreamWardenMiddleware(compressed_stream_app(encoding, EVENTS), dialect="generic")
    async with serve_in_process(app) as guarded:
        response = await raw_get(guarded)
    assert "content-encoding" not in response.headers
    decoder = SSEDecoder()
    events = [e.data for e in decoder.feed(response.content) + decoder.close()]
    assert events == [f"token {i}" for i in range(50)]
    record = app.streams.finished[-1]
    assert record.meter.end_state == "completed"


async def test_a_compressed_stream_cut_mid_event_gets_its_error_event() -> None:
    cut = EVENTS + b"data: half an ev"
    app = StreamWardenMiddleware(compressed_stream_app("gzip", cut, cut=True), dialect="generic")
    async with serve_in_process(app) as guarded, httpx.AsyncClient() as client:
        body = await read_broken(client, "GET", guarded + "/v1/stream")  # generic: broken
    assert b"stream_truncated" in body


async def test_a_compressed_bomb_from_the_app_ends_with_event_too_large() -> None:
    # 64 MiB of one endless event, compressed to about 64 KiB.
    endless = b"data: " + b"a" * (64 * 1024 * 1024)
    app = StreamWardenMiddleware(
        compressed_stream_app("gzip", endless), dialect="generic", max_event_bytes="1MiB"
    )
    async with serve_in_process(app) as guarded, httpx.AsyncClient() as client:
        body = await read_broken(client, "GET", guarded + "/v1/stream")  # generic: broken
    assert b"event_too_large" in body
    assert len(body) < 4096
