"""The WHATWG and web-platform-tests SSE corpus, through the sidecar, at every split.

Each case's stream is served by a real upstream as two HTTP chunks split at
every position (the upstream client hands the relay one body piece per
chunk, so each split reaches the relay as its own read, whatever TCP does).
With ``dialect: generic`` (no terminal event), a stream that ends at an
event boundary must end clean: the client decodes exactly the case's events
and gets no error event. A stream that ends inside an unfinished block is a
truncation in any dialect, and gets ``stream_truncated``, at every split
alike.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sidecars import StartSidecar
from sse_corpus import ALL_CASES, CASE_IDS, Case
from streamwarden.core.sse import SSEDecoder, SSEFramer
from upstreams import raw_upstream, read_request


def ends_at_a_boundary(stream: bytes) -> bool:
    framer = SSEFramer()
    framer.feed(stream)
    return framer.pending_bytes == 0


@pytest.fixture(scope="module")
def corpus() -> list[Case]:
    return list(ALL_CASES)


async def test_every_case_at_every_split_ends_as_the_stream_does(
    corpus: list[Case], start_sidecar: StartSidecar
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            _, case_index, at = head.split(b" ")[1].decode().strip("/").split("/")
            stream = corpus[int(case_index)].stream
            first, second = stream[: int(at)], stream[int(at) :]
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for part in (first, second):
                if part:
                    writer.write(b"%x\r\n%b\r\n" % (len(part), part))
                    await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    failures: list[str] = []
    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url, dialect="generic", keepalive_interval=0)
        async with aiohttp.ClientSession() as session:
            for index, case in enumerate(corpus):
                clean = ends_at_a_boundary(case.stream)
                expected = case.expected_events()
                for at in range(len(case.stream) + 1):
                    url = f"{sidecar.proxy_url}/case/{index}/{at}"
                    body, broken = b"", False
                    async with session.get(url) as response:
                        try:
                            async for part in response.content.iter_any():
                                body += part
                        except aiohttp.ClientPayloadError:
                            broken = True  # no terminating chunk
                    decoder = SSEDecoder()
                    events = decoder.feed(body) + decoder.close()
                    errors = [e for e in events if e.event == "error"]
                    if clean and (errors or broken or events != expected):
                        failures.append(f"{case.name} split at {at}: {body!r}")
                    elif not clean and (
                        len(errors) != 1
                        or b"stream_truncated" not in errors[0].data.encode()
                        # generic: the error event, then a broken body (never quieter)
                        or not broken
                    ):
                        failures.append(f"{case.name} split at {at} (unfinished): {body!r}")
    assert not failures, f"{len(failures)} failures, e.g.: {failures[:5]}"


def test_the_corpus_has_cases_of_both_endings(corpus: list[Case]) -> None:
    endings = {ends_at_a_boundary(case.stream) for case in corpus}
    assert endings == {True, False}
    assert CASE_IDS
