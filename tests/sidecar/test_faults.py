"""Faults at every point, through the sidecar: the client always sees a whole stream or an
error it can detect, the upstream is closed, and nothing is left behind.

(The common mock faults per dialect are in ``test_sidecar_streams.py``; these are
the ones that need a hand-made upstream or client.)"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from sidecars import StartSidecar
from streamwarden.core.sse import SSEDecoder
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock import MockServer
from upstreams import ServeUpstream
from waiting import wait_for, wait_until_settled

CHAT = "/v1/chat/completions"
FAST = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "8"}


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_upstream(handler: RawHandler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=headers or {}, json={"stream": True}) as response:
            return response.status, await response.read()


async def test_upstream_resetting_before_headers_is_a_502(start_sidecar: StartSidecar) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()

    server, url = await raw_upstream(reset)
    try:
        sidecar = await start_sidecar(url)
        status, body = await post(sidecar.proxy_url + CHAT)
        assert status == 502
        assert b"upstream_unreachable" in body
    finally:
        server.close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STALL_MID_EVENT = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunk(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    + chunk(b'data: {"choices":[')
)


async def test_upstream_stalling_mid_event_times_out_and_drops_the_partial_event(
    start_sidecar: StartSidecar,
) -> None:
    closed = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(STALL_MID_EVENT)
        await reader.read()  # returns when the proxy closes its side
        closed.set()

    server, url = await raw_upstream(stall)
    try:
        sidecar = await start_sidecar(url, upstream_idle_timeout="300ms")
        status, body = await post(sidecar.proxy_url + CHAT)
        assert status == 200
        events = SSEDecoder().feed(body)
        assert '"content":"a"' in events[0].data
        assert '"code":"upstream_timeout"' in events[-1].data
        assert b'{"choices":[\n' not in body  # the partial event never reached the client
        async with asyncio.timeout(1):
            await closed.wait()  # and the upstream was closed
    finally:
        server.close()


async def test_headers_then_nothing_times_out_with_an_error_event(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, upstream_idle_timeout="300ms")
    headers = {**FAST, "x-mock-fault": "stall", "x-mock-fault-after": "0", "x-mock-request-id": "h"}
    status, body = await post(sidecar.proxy_url + CHAT, headers)
    assert status == 200
    assert b'"code":"upstream_timeout"' in body
    assert (await mock.stats.wait_ended("h")).closed_early


async def test_ten_mebibytes_without_a_newline_hit_the_default_event_limit(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)  # max_event_bytes: 8MiB
    headers = {**FAST, "x-mock-fault": "giant-event", "x-mock-size": str(10 << 20)}
    status, body = await post(sidecar.proxy_url + CHAT, headers)
    assert status == 200
    assert len(body) < 1 << 20  # the giant event was never forwarded
    assert b'"code":"event_too_large"' in body
    assert sidecar.tracker.finished[-1].meter.end_state == "limit_exceeded"


async def test_invalid_utf8_passes_through_byte_for_byte(
    start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    payload = b'data: {"choices":[{"delta":{"content":"\xff\xfe bad \xc3"}}]}\n\ndata: [DONE]\n\n'

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(payload)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{tail:.*}", handler)
    sidecar = await start_sidecar(await serve_upstream(app))
    _, body = await post(sidecar.proxy_url + CHAT)
    assert body == payload
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"


@pytest.mark.parametrize("with_body", [True, False])
@pytest.mark.parametrize("status", [429, 500, 503])
async def test_error_statuses_pass_through_with_and_without_body(
    mock: MockServer, start_sidecar: StartSidecar, status: int, with_body: bool
) -> None:
    sidecar = await start_sidecar(mock.url)
    headers = {
        "x-mock-fault": "error-status",
        "x-mock-status": str(status),
        "x-mock-request-id": "same",  # the mock names it in the body
    }
    if not with_body:
        headers["x-mock-body"] = "0"
    direct = await post(mock.url + CHAT, headers)
    proxied = await post(sidecar.proxy_url + CHAT, headers)
    assert proxied == direct
    assert proxied[0] == status


async def test_a_client_reading_at_a_trickle_is_cut_and_the_upstream_closed(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, client_write_timeout="500ms", keepalive_interval=0)
    headers = {
        "x-mock-tps": "0",
        "x-mock-ttft": "0",
        "x-mock-tokens": "100000",
        "x-mock-request-id": "trickle",
    }
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", sidecar.proxy_port))
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 16\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + '\r\n{"stream": true}'
    )
    await loop.sock_sendall(sock, request.encode())
    try:
        async with asyncio.timeout(10):
            while not sidecar.tracker.finished:
                await loop.sock_recv(sock, 1)  # one byte at a time, slowly
                await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        pass
    finally:
        sock.close()
    record = sidecar.tracker.finished[-1]
    assert record.meter.end_state == "client_too_slow"
    assert record.meter.error_code is None  # it is not reading: no error event
    upstream = await mock.stats.wait_ended("trickle")
    assert upstream.closed_early and upstream.tokens_generated < 100000


async def test_client_leaving_before_headers_closes_the_upstream(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url)
    headers = {"x-mock-fault": "slow-headers", "x-mock-delay": "10", "x-mock-request-id": "pre"}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await post(sidecar.proxy_url + CHAT, headers)
    record = await mock.stats.wait_ended("pre", timeout=2)
    assert record.closed_early


@pytest.fixture
async def counting_sidecar(
    mock: MockServer, start_sidecar: StartSidecar
) -> AsyncIterator[tuple[Sidecar, int, int]]:
    sidecar = await start_sidecar(mock.url)
    await post(sidecar.proxy_url + CHAT, FAST)  # warm up pools and lazy objects
    # The baseline once the warm-up's closes have all landed.
    await wait_until_settled(usage, quiet=0.2)
    gc.collect()
    yield sidecar, *usage()


def usage() -> tuple[int, int]:
    """(asyncio tasks of this loop, open file descriptors of this process)."""
    return len(asyncio.all_tasks()), len(os.listdir("/proc/self/fd"))


async def test_client_leaving_at_every_point_of_a_stream(
    mock: MockServer, counting_sidecar: tuple[Sidecar, int, int]
) -> None:
    sidecar, tasks_before, fds_before = counting_sidecar
    headers = {"x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "6"}
    whole = (await post(sidecar.proxy_url + CHAT, headers))[1]
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 16\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + '\r\n{"stream": true}'
    ).encode()
    for cut in range(0, len(whole), max(1, len(whole) // 40)):
        reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.proxy_port)
        writer.write(request)
        received = b""
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        while len(received) < cut:
            data = await reader.read(cut - len(received))
            if not data:
                break
            received += data
        writer.transport.abort()
    async with asyncio.timeout(5):
        while sidecar.tracker.active or any(not r.ended for r in mock.stats.records):
            await asyncio.sleep(0.01)
    # Then until the last handler tasks have ended and their sockets closed.
    await wait_until_settled(usage, quiet=0.2)
    gc.collect()
    states = {str(r.meter.end_state) for r in sidecar.tracker.finished}
    assert states <= {"completed", "client_cancelled"}
    pool = sidecar.proxy.pool
    assert pool is not None and not pool.busy
    idle = pool.idle_count
    assert len(asyncio.all_tasks()) <= tasks_before + idle + 2
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2 * idle + 4


async def _raw_stream_request(port: int, headers: dict[str, str], version: str) -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    request = (
        f"POST {CHAT} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 16\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + '\r\n{"stream": true}'
    )
    await loop.sock_sendall(sock, request.encode())
    return sock


async def _read_to_close(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(20):
        while chunk := await loop.sock_recv(sock, 65536):
            received += chunk
    return bytes(received)


def _events_of_chunked(raw: bytes) -> tuple[bytes, list[str]]:
    """Decode an HTTP/1.1 chunked response; its head and the SSE data fields of its body."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = bytearray()
    at = 0
    while True:
        line_end = rest.index(b"\r\n", at)
        size = int(rest[at:line_end], 16)
        if size == 0:
            break
        body += rest[line_end + 2 : line_end + 2 + size]
        at = line_end + 2 + size + 2
    decoder = SSEDecoder()
    return head, [event.data for event in decoder.feed(bytes(body)) + decoder.close()]


async def test_an_upstream_much_faster_than_a_paused_client_is_held_back_and_loses_nothing(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    """Backpressure end to end: the sidecar stops reading the upstream, it does not buffer.

    The client reads nothing for a while; the upstream (as fast as it can
    write) gets only as far as the socket buffers between them, and once the
    client reads, every event arrives, in order, and the stream completes.
    """
    tokens = 100_000
    sidecar = await start_sidecar(mock.url, client_write_timeout="10s", keepalive_interval=0)
    headers = {**FAST, "x-mock-tokens": str(tokens), "x-mock-request-id": "flood"}
    sock = await _raw_stream_request(sidecar.proxy_port, headers, "1.1")
    try:
        # The client reads nothing: the buffers between fill up, and then
        # the upstream (which writes over 20,000 tokens a second when it
        # can) gets no further. However long filling takes on a busy
        # machine, the mock's count must stop growing well short of the end.
        await wait_for(lambda: mock.stats.get("flood") is not None, what="the mock saw the request")
        record = mock.stats.get("flood")
        assert record is not None
        held = await wait_until_settled(lambda: record.tokens_generated, quiet=0.5, timeout=30)
        assert held < tokens // 2 and not record.ended, held
        raw = await _read_until_last_chunk(sock)
    finally:
        sock.close()
    head, data = _events_of_chunked(raw)
    assert head.startswith(b"HTTP/1.1 200")
    assert data[-1] == "[DONE]"
    assert len(data) >= tokens  # every token's chunk (plus the usage chunk and [DONE])
    finished = sidecar.tracker.finished[-1]
    assert finished.meter.end_state == "completed"
    assert finished.meter.tokens_delivered == finished.meter.tokens_generated
    assert (await mock.stats.wait_ended("flood")).tokens_generated == tokens


async def _read_until_last_chunk(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(20):
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                break
            received += chunk
    return bytes(received)


async def test_an_http_1_0_client_gets_the_whole_stream_ended_by_the_close(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    """HTTP/1.0 has no chunked encoding: the stream is the body up to the close."""
    sidecar = await start_sidecar(mock.url)
    headers = {**FAST, "x-mock-tokens": "50", "x-mock-request-id": "old-client"}
    sock = await _raw_stream_request(sidecar.proxy_port, headers, "1.0")
    try:
        raw = await _read_to_close(sock)
    finally:
        sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    decoder = SSEDecoder()
    data = [event.data for event in decoder.feed(body) + decoder.close()]
    assert data[-1] == "[DONE]" and len(data) >= 50
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"


async def test_events_from_one_upstream_read_leave_in_one_write(
    start_sidecar: StartSidecar,
) -> None:
    """Three events the upstream sends as three HTTP chunks in one write arrive as one chunk."""
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    events = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(3)]
    burst = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    burst_now, done_now = asyncio.Event(), asyncio.Event()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(16)  # the small JSON body
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(first), first)
        )
        await burst_now.wait()
        writer.write(burst)  # one write, three chunks
        await done_now.wait()
        done = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        writer.close()

    server, url = await raw_upstream(upstream)
    sidecar = await start_sidecar(url)
    sock = await _raw_stream_request(sidecar.proxy_port, {}, "1.1")
    loop = asyncio.get_running_loop()

    async def receive_until(end: bytes) -> bytes:
        received = b""
        async with asyncio.timeout(5):
            while not received.endswith(end):
                received += await loop.sock_recv(sock, 65536)
        return received

    try:
        head = await receive_until(b'"a"}}]}\n\n\r\n')  # the stream is under way
        burst_now.set()
        chunks = await receive_until(b'"2"}}]}\n\n\r\n')
        done_now.set()
        tail = await _read_until_last_chunk(sock)
    finally:
        sock.close()
        server.close()
    size, _, rest = chunks.partition(b"\r\n")
    assert rest[: int(size, 16)] == b"".join(events)  # one HTTP chunk: one write
    _, data = _events_of_chunked(head + chunks + tail)
    assert data == [e[len(b"data: ") : -2].decode() for e in (first, *events)] + ["[DONE]"]


async def test_chunks_the_upstream_frames_its_own_way_reach_the_client_framed_as_the_sidecar_frames(
    start_sidecar: StartSidecar,
) -> None:
    """A read that is one chunk, framed as the client's chunk would be, is written as it came.

    Any other size line (upper-case hex, leading zeros) is legal HTTP, but
    the client gets the sidecar's own framing whatever the upstream's: each
    chunk here comes in a read of its own, and each leaves as ``%x``, CRLF,
    the same bytes, CRLF.
    """
    events = [b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i for i in range(4)]
    done = b"data: [DONE]\n\n"
    heads = [b"%x", b"%X", b"%04x", b"%x"]  # as the client's, upper case, padded, as the client's
    sent = asyncio.Queue[int]()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.read(16)  # the small JSON body
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for event, head in zip(events, heads, strict=True):
            await sent.get()  # the client has the one before: this chunk is a read of its own
            writer.write(head % len(event) + b"\r\n" + event + b"\r\n")
            await writer.drain()
        await sent.get()
        writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
        await writer.drain()
        writer.close()

    server, url = await raw_upstream(upstream)
    sidecar = await start_sidecar(url, keepalive_interval=0)
    sock = await _raw_stream_request(sidecar.proxy_port, {}, "1.1")
    loop = asyncio.get_running_loop()
    received = b""

    async def receive_until(done: Callable[[], bool]) -> None:
        nonlocal received
        while not done():
            more = await loop.sock_recv(sock, 65536)
            assert more, received
            received += more

    try:
        async with asyncio.timeout(10):
            await receive_until(lambda: b"\r\n\r\n" in received)
            for event in events:
                sent.put_nowait(0)
                await receive_until(lambda: event + b"\r\n" in received)  # noqa: B023
            sent.put_nowait(0)
            await receive_until(lambda: received.endswith(b"\r\n0\r\n\r\n"))
    finally:
        sock.close()
        server.close()
    body = received.partition(b"\r\n\r\n")[2]
    framed = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (*events, done))
    assert body == framed + b"0\r\n\r\n"
