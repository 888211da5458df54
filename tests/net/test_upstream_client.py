"""The sidecar's own upstream client, against hostile and unusual real servers.

Each upstream here is a real server on loopback: a raw asyncio server where
the test needs bytes no HTTP library would send (an unsolicited response,
a bomb, no ``100 Continue``), else aiohttp. Each behaviour first shows the
problem on a direct connection with aiohttp's client (the one the sidecar
used before it had its own), then its absence through the sidecar.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import zlib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from locations import FIXTURES
from sidecars import StartSidecar
from streamwarden.core.sse import SSEDecoder
from upstreams import RawHandler, ServeUpstream, port_of, raw_upstream, read_request
from waiting import wait_for, wait_until_settled


def response(body: bytes, content_type: bytes = b"text/plain", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body
    )


async def get(url: str, **kwargs: object) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, **kwargs) as resp:  # type: ignore[arg-type]
            return resp.status, await resp.read()


# -- a client never receives bytes meant for another -----------------------------


def _smuggling_upstream() -> RawHandler:
    """Answers each request, then at once writes a second, unsolicited response."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            path = head.split(b" ")[1]
            writer.write(response(b"answer to " + path) + response(b"STRAY"))
            await writer.drain()

    return handler


async def test_a_stray_response_right_after_an_answer_never_reaches_the_next_client(
    start_sidecar: StartSidecar,
) -> None:
    """Two responses to one request, in one write: the second is nobody's answer.

    (aiohttp 3.14's client drops such a connection too; the idle case below
    is the one it gets wrong.)
    """
    async with raw_upstream(_smuggling_upstream()) as upstream:
        sidecar = await start_sidecar(upstream.url)
        answers = [(await get(f"{sidecar.proxy_url}/req{i}"))[1] for i in range(5)]
        assert answers == [f"answer to /req{i}".encode() for i in range(5)]
        assert upstream.connections == 5  # each poisoned connection was dropped


async def test_an_idle_pooled_connection_that_receives_bytes_is_closed_not_reused(
    start_sidecar: StartSidecar,
) -> None:
    stray = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        writer.write(response(b"answer to " + head.split(b" ")[1]))
        await writer.drain()
        await stray.wait()  # the test says when the connection is idle in the pool
        writer.write(response(b"STRAY"))
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError):
            head, _ = await read_request(reader)  # a poisoned pool would send here
            writer.write(response(b"answer to " + head.split(b" ")[1]))
            await writer.drain()

    async with raw_upstream(handler) as upstream:
        # Without streamwarden: the stray bytes wait in aiohttp's pooled
        # connection and become the next request's answer.
        async with aiohttp.ClientSession() as session:
            async with session.get(upstream.url + "/first") as first:
                await first.read()
            connector = session.connector
            assert connector is not None
            stray.set()
            await wait_for(
                lambda: any(
                    len(protocol._buffer) > 0  # a parsed response nobody asked for
                    for conns in connector._conns.values()  # type: ignore[attr-defined]
                    for protocol, _ in conns
                ),
                what="aiohttp buffered the stray response",
            )
            async with session.get(upstream.url + "/second") as second:
                assert await second.read() == b"STRAY"

        stray.clear()
        sidecar = await start_sidecar(upstream.url)
        pool = sidecar.proxy.pool
        assert pool is not None
        assert (await get(sidecar.proxy_url + "/one"))[1] == b"answer to /one"
        assert pool.idle_count == 1
        stray.set()
        await wait_for(lambda: pool.idle_count == 0, what="the poisoned connection was closed")
        assert (await get(sidecar.proxy_url + "/two"))[1] == b"answer to /two"


async def test_one_pooled_connection_serves_sequential_requests_and_a_cut_one_never_returns(
    start_sidecar: StartSidecar,
) -> None:
    """Coverage of the sidecar's own pool (aiohttp's did the same; no direct demo)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            path = head.split(b" ")[1]
            if path == b"/cut":
                # Promise 100 bytes, send 10, close: the body did not end cleanly.
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
                await writer.drain()
                return
            writer.write(response(b"ok " + path))
            await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        pool = sidecar.proxy.pool
        assert pool is not None
        for i in range(5):
            assert (await get(f"{sidecar.proxy_url}/r{i}"))[1] == f"ok /r{i}".encode()
        assert upstream.connections == 1 and pool.idle_count == 1
        with pytest.raises(aiohttp.ClientPayloadError):
            await get(sidecar.proxy_url + "/cut")  # the client is cut too, not misled
        await wait_for(lambda: pool.idle_count == 0 and not pool.busy)
        assert (await get(sidecar.proxy_url + "/after"))[1] == b"ok /after"
        assert upstream.connections == 2


async def test_a_reused_connection_closed_unanswered_is_retried_only_when_that_is_safe(
    start_sidecar: StartSidecar,
) -> None:
    """The race every pool meets: the upstream closes an idle connection as a request goes out.

    The upstream answers the first request on each connection and closes
    the connection on the second one without a byte of answer, as if its
    idle timeout had fired just then. A GET is sent again on a new
    connection; a POST (which may start a generation) is not: sending it
    twice could generate twice, so it gets a 502 unless it carries an
    Idempotency-Key.
    """
    served: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        served.append(head.split(b" ")[1])
        writer.write(response(b"ok"))
        await writer.drain()
        await read_request(reader)  # the second request: closed unanswered

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        pool = sidecar.proxy.pool
        assert pool is not None
        async with aiohttp.ClientSession() as session:
            for method, path, headers, status in [
                ("GET", "/a", {}, 200),
                ("GET", "/b", {}, 200),  # conn 1 closes unanswered; retried on conn 2
                ("POST", "/c", {}, 502),  # conn 2 closes unanswered; not retried
                ("GET", "/d", {}, 200),
                ("POST", "/e", {"Idempotency-Key": "k1"}, 200),  # retried: said safe
            ]:
                await wait_for(lambda: not pool.busy)
                async with session.request(
                    method, sidecar.proxy_url + path, data=b"{}", headers=headers
                ) as resp:
                    assert resp.status == status, (method, path)
        assert served == [b"/a", b"/b", b"/d", b"/e"]
        assert upstream.connections == 4


# -- what an upstream may send ----------------------------------------------------


async def test_interim_responses_before_the_final_one_are_skipped(
    start_sidecar: StartSidecar,
) -> None:
    """Coverage of the sidecar's own client (aiohttp's skipped them too)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 100 Continue\r\n\r\n"
            b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
            + response(b"final", extra=b"X-Final: yes\r\n")
        )
        await writer.drain()
        await reader.read()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        async with aiohttp.ClientSession() as session:
            async with session.get(sidecar.proxy_url + "/x") as resp:
                assert resp.status == 200
                assert resp.headers["X-Final"] == "yes"
                assert await resp.read() == b"final"


@pytest.mark.parametrize("status", [204, 304])
async def test_head_204_and_304_have_no_body_and_the_connection_is_reused(
    start_sidecar: StartSidecar, status: int
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            method, path = head.split(b" ")[:2]
            if method == b"HEAD":
                # The length of the body a GET would get, and no body.
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n")
            elif path == b"/empty":
                writer.write(f"HTTP/1.1 {status} Whatever\r\nETag: x\r\n\r\n".encode())
            else:
                writer.write(response(b"body"))
            await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        async with aiohttp.ClientSession() as session:
            async with session.head(sidecar.proxy_url + "/h") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Length"] == "5000"
            for _ in range(3):
                async with session.get(sidecar.proxy_url + "/empty") as resp:
                    assert resp.status == status
                    assert await resp.read() == b""
            async with session.get(sidecar.proxy_url + "/after") as resp:
                assert await resp.read() == b"body"
        # One connection served the HEAD, the empty answers and the last GET.
        assert upstream.connections == 1


async def test_a_response_without_length_is_read_until_the_upstream_closes(
    start_sidecar: StartSidecar,
) -> None:
    """Coverage of the sidecar's own client (aiohttp's read to close too)."""
    payload = os.urandom(300_000)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")
        for at in range(0, len(payload), 50_000):
            writer.write(payload[at : at + 50_000])
            await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        assert await get(sidecar.proxy_url + "/eof") == (200, payload)
        pool = sidecar.proxy.pool
        assert pool is not None
        assert pool.idle_count == 0  # read to close: nothing to reuse


async def test_an_upstream_header_with_a_control_byte_is_a_502_not_a_500(
    start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nSet-Cookie: session=SECRET\x01x\r\nContent-Length: 2\r\n\r\nok"
        )
        await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        status, body = await get(sidecar.proxy_url + "/x?key=APIKEY")
    assert status == 502
    assert b"upstream_unreachable" in body
    assert "SECRET" not in caplog.text and "APIKEY" not in caplog.text
    assert "Traceback" not in caplog.text


# -- uploads ------------------------------------------------------------------------


async def test_expect_100_continue_uploads_complete_against_an_upstream_that_never_sends_100(
    start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A server that ignores Expect: it never writes 100, it waits for the body.
        head, body = await read_request(reader)
        expects = b"expect:" in head.lower()
        answer = json.dumps({"bytes": len(body), "saw_expect": expects}).encode()
        writer.write(response(answer, b"application/json"))
        await writer.drain()

    upload = tmp_path / "upload.bin"
    upload.write_bytes(os.urandom(3 * 1024 * 1024))
    async with raw_upstream(handler) as upstream:
        # Without streamwarden: aiohttp's client, asked to expect 100, holds
        # the body until a 100 that never comes.
        async with aiohttp.ClientSession() as session:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.0):
                    await session.post(
                        upstream.url + "/up", data=upload.read_bytes(), expect100=True
                    )

        sidecar = await start_sidecar(upstream.url)
        # curl sends Expect: 100-continue for an upload this large, and here
        # waits for the 100 longer than it may run: the sidecar must send it.
        curl = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "20", "--expect100-timeout", "60",
            "-H", "Expect: 100-continue",
            "--data-binary", f"@{upload}", sidecar.proxy_url + "/up",
            stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await curl.communicate()
    assert curl.returncode == 0
    assert json.loads(out) == {"bytes": upload.stat().st_size, "saw_expect": False}


# -- a client that never reads ----------------------------------------------------


async def test_a_client_that_never_reads_a_huge_json_response_is_cut_and_the_upstream_closed(
    start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    block = b'{"pad": "' + b"x" * 65_000 + b'"},\n'
    written = 0
    finished = asyncio.Event()

    async def huge(request: web.Request) -> web.StreamResponse:
        nonlocal written
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1024**3
        await resp.prepare(request)
        try:
            while written < 1024**3:
                await resp.write(block)
                written += len(block)
        finally:
            finished.set()
        return resp

    app = web.Application()
    app.router.add_get("/huge", huge)
    port = port_of(await serve_upstream(app))

    async def stalled_client(target_port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", target_port))
        await asyncio.get_running_loop().sock_sendall(
            sock, b"GET /huge HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        return sock

    # Without streamwarden the upstream's write just waits, for ever.
    direct = await stalled_client(port)
    stuck_at = await wait_until_settled(lambda: written, quiet=0.5, timeout=30)
    assert not finished.is_set() and stuck_at < 1024**3
    direct.close()
    await asyncio.wait_for(finished.wait(), 10)

    finished.clear()
    written = 0
    sidecar = await start_sidecar(f"http://127.0.0.1:{port}", client_write_timeout="300ms")
    through = await stalled_client(sidecar.proxy_port)
    try:
        # The sidecar cuts the client after client_write_timeout and
        # closes the upstream connection: the upstream's write fails.
        await asyncio.wait_for(finished.wait(), 20)
        assert written < 1024**3
        pool = sidecar.proxy.pool
        assert pool is not None
        await wait_for(lambda: not pool.busy and pool.idle_count == 0)
        # And the client's connection is cut (reset), not left open.
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10):
            with contextlib.suppress(ConnectionResetError):
                while await loop.sock_recv(through, 1 << 20):
                    pass
    finally:
        through.close()


# -- stream_media_types, with and without early headers -------------------------


@pytest.mark.parametrize("early", ["0", "50ms"])
async def test_a_configured_stream_media_type_is_relayed_with_and_without_early_headers(
    start_sidecar: StartSidecar, early: str
) -> None:
    prefill_over = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await prefill_over.wait()  # a prefill that lasts past early_headers_after
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.acme-events\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for data in (b"data: one\n\n", b"data: two\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(
            upstream.url,
            stream_media_types=["application/vnd.acme-events"],
            early_headers_after=early,
            keepalive_interval="100ms",
            dialect="generic",
        )

        async def end_the_prefill() -> None:
            if early != "0":  # once the early headers and a keep-alive went out
                await wait_for(
                    lambda: any(s.relay.meter.keepalives for s in sidecar.tracker.active),
                    what="a keep-alive in the prefill",
                )
            prefill_over.set()

        ending = asyncio.create_task(end_the_prefill())
        async with aiohttp.ClientSession() as session:
            async with session.post(
                sidecar.proxy_url + "/v1/stream", json={"stream": True}
            ) as resp:
                body = await resp.read()
        await ending
    decoder = SSEDecoder()
    events = [e.data for e in decoder.feed(body) + decoder.close()]
    assert events == ["one", "two"], body
    record = sidecar.tracker.finished[-1]
    assert record.meter.end_state == "completed"
    if early != "0":
        assert body.startswith(b": keep-alive\n\n")  # kept alive through the prefill


# -- decompression bombs --------------------------------------------------------------


def _bomb(encoding: str, shape: str, inflated: int) -> bytes:
    """A compressed body that inflates to ``inflated`` bytes of one endless event or tiny ones."""
    if encoding == "gzip":
        compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    else:
        compressor = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS)
    unit = b"a" * 1024 * 1024 if shape == "endless" else b"data: x\n\n" * 116_508
    parts = [compressor.compress(b"data: " if shape == "endless" else b"")]
    for _ in range(inflated // len(unit)):
        parts.append(compressor.compress(unit))
    parts.append(compressor.flush())
    return b"".join(parts)


@pytest.fixture(scope="module")
def bombs() -> dict[tuple[str, str], bytes]:
    # A quarter to half a megabyte each, inflating to 256 MiB (deflate tops
    # out near 1:1000): 30 times the event limit, and cheap to build.
    return {
        (encoding, shape): _bomb(encoding, shape, 256 * 1024**2)
        for encoding in ("gzip", "deflate")
        for shape in ("endless", "tiny")
    }


def sidecar_process(upstream: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int, int]:
    """``streamwarden run`` in a process of its own (its RSS and loop are its alone)."""
    port, admin = _free_port(), _free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "streamwarden.cli", "run", "--upstream", upstream,
            "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}",
        ],
        env={**os.environ, **env},
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return process, port, admin


async def wait_healthy(session: aiohttp.ClientSession, admin: int) -> None:
    async with asyncio.timeout(20):
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{admin}/healthz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)  # polling: the process is still starting


async def healthz_prober(admin: int) -> asyncio.subprocess.Process:
    """A process timing GET /healthz in a loop (one line each) until its stdin closes."""
    prober = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HEALTHZ_PROBE, f"http://127.0.0.1:{admin}/healthz",
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert prober.stdout is not None
    assert await prober.stdout.readline() == b"ready\n"
    return prober


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("shape", ["endless", "tiny"])
async def test_a_decompression_bomb_keeps_memory_bounded_and_healthz_answering(
    bombs: dict[tuple[str, str], bytes], encoding: str, shape: str
) -> None:
    assert gzip  # the module's gzip wrapper is what "gzip" means here
    bomb = bombs[(encoding, shape)]
    assert len(bomb) < 1024 * 1024

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: "
            + encoding.encode()
            + b"\r\nContent-Length: "
            + str(len(bomb)).encode()
            + b"\r\n\r\n"
        )
        for at in range(0, len(bomb), 16384):
            writer.write(bomb[at : at + 16384])
            await writer.drain()

    limit = 4 * 1024 * 1024
    async with raw_upstream(handler) as upstream:
        process, port, admin = sidecar_process(
            upstream.url,
            {
                "STREAMWARDEN_MAX_EVENT_BYTES": str(limit),
                "STREAMWARDEN_CLIENT_WRITE_TIMEOUT": "60s",
            },
        )
        try:
            async with aiohttp.ClientSession() as session:
                await wait_healthy(session, admin)
                # Warm both paths so lazily built objects are in the baseline.
                async with session.get(f"http://127.0.0.1:{admin}/metrics") as r:
                    await r.read()
                baseline = _rss(process.pid)
                peak = baseline

                async def sample_rss() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, _rss(process.pid))
                        await asyncio.sleep(0.005)

                sampler = asyncio.create_task(sample_rss())
                # /healthz is timed from a process of its own: this one is
                # busy reading the flood, and its own loop's delays are not
                # the sidecar's.
                prober = await healthz_prober(admin)
                assert prober.stdin is not None
                try:
                    async with session.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json={"stream": True},
                        timeout=aiohttp.ClientTimeout(total=60),
                    ) as resp:
                        assert resp.status == 200
                        assert "Content-Encoding" not in resp.headers
                        if shape == "endless":
                            body = await resp.read()
                            assert b"event_too_large" in body
                        else:
                            # The client reads nothing for a while: the
                            # inflation must wait for it, not fill memory.
                            await wait_until_settled(lambda: peak, quiet=1.0, timeout=30)
                            got = 0
                            async for chunk in resp.content.iter_any():
                                got += len(chunk)
                                if got > 2 * limit:
                                    break  # enough: the rest is more of the same
                            assert got > 2 * limit
                finally:
                    sampler.cancel()
                    prober.stdin.close()
                    out, _ = await asyncio.wait_for(prober.communicate(), 20)
        finally:
            process.terminate()
            process.wait(timeout=10)
    # An endless bomb ends at max_event_bytes, which a fast build reaches in
    # a few milliseconds: there may be one answer only, the one in flight.
    # Every one came, each within the prober's own 5 s bound (a starved loop
    # fails it); how long each took is a latency, not this test's.
    assert out.split() and prober.returncode == 0
    grown = peak - baseline
    assert grown < limit + 16 * 1024 * 1024, (baseline, peak)


# Times GET /healthz in a loop, one line per answer, until stdin closes.
_HEALTHZ_PROBE = """
import sys, threading, time, urllib.request
url = sys.argv[1]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("ready", flush=True)
while True:  # at least once, however soon stdin closes
    began = time.monotonic()
    urllib.request.urlopen(url, timeout=5).read()
    print(time.monotonic() - began, flush=True)
    if done.is_set():
        break
    time.sleep(0.01)
"""


# -- secrets ------------------------------------------------------------------------


async def test_no_secret_reaches_a_log_line_and_url_credentials_are_sent_upstream(
    start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    """Userinfo, query-string keys, client headers and upstream Set-Cookie stay out of logs.

    Credentials in the configured upstream URL are the operator's: they go
    upstream as Basic auth in place of the client's Authorization (before,
    both together were a 500).
    """
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            seen.append(head)
            if b"/broken" in head:
                writer.write(b"HTTP/1.1 200 OK\r\nSet-Cookie: sid=COOKIESECRET\x01\r\n\r\n")
                await writer.drain()
                return
            writer.write(response(b"ok", extra=b"Set-Cookie: sid=COOKIESECRET\r\n"))
            await writer.drain()

    caplog.set_level(logging.DEBUG)
    async with raw_upstream(handler) as upstream:
        url = f"http://svc:URLPASSWORD@127.0.0.1:{upstream.port}"
        sidecar = await start_sidecar(url)
        headers = {"Authorization": "Bearer CLIENTSECRET", "x-goog-api-key": "GOOGSECRET"}
        assert await get(sidecar.proxy_url + "/ok?key=QUERYSECRET", headers=headers) == (
            200,
            b"ok",
        )
        status, _ = await get(sidecar.proxy_url + "/broken?key=QUERYSECRET", headers=headers)
        assert status == 502
    expected = "Basic " + base64.b64encode(b"svc:URLPASSWORD").decode()
    assert f"Authorization: {expected}".encode() in seen[0]
    assert b"CLIENTSECRET" not in seen[0]
    logged = caplog.text
    assert "upstream" in logged  # the 502 was logged, and what follows is not in it
    for secret in ("URLPASSWORD", "QUERYSECRET", "CLIENTSECRET", "GOOGSECRET", "COOKIESECRET"):
        assert secret not in logged, secret


# -- one flooding upstream does not starve the others -------------------------------

FLOOD_UPSTREAM = FIXTURES / "flood_upstream.py"


@pytest.mark.slow
async def test_a_flooding_stream_starves_neither_healthz_nor_another_stream() -> None:
    """Tiny events at full speed; /healthz and a ticking stream are served all through it.

    Every party is a process of its own (the upstream, the sidecar, curl
    reading the flood, the /healthz prober), so what is tested is the
    sidecar's event loop. The flood does not end until the test has had its
    40 ticks and 10 answers of /healthz (and 16 MiB went): a loop that
    served the flood alone would starve them for ever, and the wait runs into
    its bound. How long they waited is a latency, not this test's.
    """
    upstream_port = _free_port()
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, str(FLOOD_UPSTREAM), str(upstream_port), stdout=subprocess.PIPE
    )
    assert upstream.stdout is not None
    assert await upstream.stdout.readline() == b"ready\n"
    sidecar, port, admin = sidecar_process(
        f"http://127.0.0.1:{upstream_port}", {"STREAMWARDEN_DIALECT": "generic"}
    )
    prober: asyncio.subprocess.Process | None = None
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(60):
            await wait_healthy(session, admin)
            flood = await asyncio.create_subprocess_exec(
                "curl", "-sSN", "--max-time", "60", "-o", "/dev/null", "-w", "%{size_download}",
                "-H", "Accept: text/event-stream", f"http://127.0.0.1:{port}/flood",
                stdout=subprocess.PIPE,
            )  # fmt: skip
            assert await upstream.stdout.readline() == b"flooding\n"
            prober = await healthz_prober(admin)
            assert prober.stdin is not None and prober.stdout is not None
            ticks = 0
            async with session.get(
                f"http://127.0.0.1:{port}/tick?n=40", headers={"Accept": "text/event-stream"}
            ) as resp:
                decoder = SSEDecoder()
                async for chunk in resp.content.iter_any():
                    ticks += len(decoder.feed(chunk))
            answered = [await prober.stdout.readline() for _ in range(10)]
            assert all(answered), "the /healthz prober gave up: an answer took over 5 s"
            # All of it while the flood was still flowing: it ends only now.
            assert flood.returncode is None
            async with session.post(f"http://127.0.0.1:{upstream_port}/stop") as stopped:
                assert stopped.status == 204
            out, _ = await flood.communicate()
            assert int(out) > 16_000_000  # the flood went through meanwhile
            prober.stdin.close()
            await prober.communicate()
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=10)
        upstream.terminate()
        await upstream.wait()
        if prober is not None and prober.returncode is None:
            prober.kill()
    assert ticks == 40
    assert prober.returncode == 0  # no /healthz failed (each is bounded by 5 s)


async def test_sequential_streams_share_one_pooled_connection(
    start_sidecar: StartSidecar,
) -> None:
    """A stream that ended whole hands its connection back, and the next stream takes it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for data in (b"data: one\n\n", b"data: [DONE]\n\n"):
                writer.write(b"%x\r\n%b\r\n" % (len(data), data))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async with raw_upstream(handler) as upstream:
        sidecar = await start_sidecar(upstream.url)
        pool = sidecar.proxy.pool
        assert pool is not None
        async with aiohttp.ClientSession() as session:
            for _ in range(4):
                async with session.post(
                    sidecar.proxy_url + "/v1/chat/completions", json={"stream": True}
                ) as resp:
                    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
                await wait_for(lambda: not pool.busy)
        assert [str(r.meter.end_state) for r in sidecar.tracker.finished] == ["completed"] * 4
        assert upstream.connections == 1 and pool.idle_count == 1
