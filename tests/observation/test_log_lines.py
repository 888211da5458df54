"""No request can write a log line of its own: a control character in a path reaches the
log escaped, in both formats, in a real ``streamwarden run`` process.

aiohttp decodes a request path, so ``%0D%0A`` in the target is a CR LF in the
path that the stream line logs; ``%E2%80%A8`` and ``%C2%85`` are U+2028 and
U+0085, which ``str.splitlines`` (and viewers built on it) take for line
breaks; ``%1B`` starts a terminal sequence. Raw control bytes in a request
head never get that far: the HTTP parser refuses them (400), and the
refusal's line carries no request bytes.

The upstream answers any path with a short event stream, so that the path
is the only thing a test varies (the mock routes by path).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from urllib.parse import unquote

import pytest
from aiohttp import web

from waiting import wait_until

FORGED = "2026-01-01 00:00:00,000 INFO streamwarden.stream: stream finished end_state=completed"
#: The target as sent: each unsafe character percent-encoded, as a client may.
TARGET = (
    "/v1/chat/completions%0D%0A"
    + FORGED.replace(" ", "%20")
    + "%E2%80%A8FORGED-LS%C2%85FORGED-NEL%1B%5B2K%7F%E2%80%AE"
)
PATH = unquote(TARGET)
#: What no line may hold raw: C0 (bar the line feed between lines), DEL, C1,
#: the Unicode separators and bidirectional overrides.
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
#: The head of a stream line: the time, not a path that quotes one.
STREAM_LINE = re.compile(r"[\d-]+ [\d:,]+ INFO streamwarden\.stream: stream finished ")
#: Raw bytes in a request head that the HTTP parser refuses before anything logs them.
RAW_TARGETS = [b"/v1\rRAW-CR", b"/v1\x1b[2KRAW-ESC", b"/v1\xe2\x80\xa8RAW-LS", b"/v1\x7fRAW-DEL"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def any_path_streams() -> AsyncIterator[str]:
    """An upstream that answers every path with two events."""

    async def stream(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        await response.write(b"data: two\n\n")
        await response.write_eof()
        return response

    runner = web.ServerRunner(web.Server(stream))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def exchange(port: int, head: bytes) -> bytes:
    """Send a raw request head, read the whole answer (the connection closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def sidecar_output(upstream: str, log_format: str) -> str:
    """Run the sidecar, stream ``TARGET`` and the raw targets through it, stop it: its stderr."""
    port = free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "streamwarden.cli", "run", "--upstream", upstream),
            *("--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"),
            *("--log-format", log_format, "--log-level", "debug"),
        ],
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    try:

        async def listening() -> bool:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True

        await wait_until(listening, timeout=30, what="the sidecar's port")
        answer = await exchange(
            port, f"GET {TARGET} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode()
        )
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"data: two\n\n\r\n0\r\n\r\n")
        for raw in RAW_TARGETS:
            head = b"GET " + raw + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
            assert (await exchange(port, head)).startswith(b"HTTP/1.0 400")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    return stderr


def assert_one_line_each(output: str) -> None:
    """Every line of ``output`` is one of the process's own, and holds nothing unsafe."""
    # A shipper that splits on "\n" and one that splits as str.splitlines agree.
    assert output.splitlines() == output.split("\n")[:-1], "a line break besides \\n"
    for line in output.splitlines():
        assert not UNSAFE.search(line), line
        assert not line.startswith(("2026-01-01", "FORGED")), line
    assert "RAW-" not in output, "bytes of a refused head reached the log"


async def test_a_path_cannot_forge_a_text_line(any_path_streams: str) -> None:
    output = await sidecar_output(any_path_streams, "text")
    assert_one_line_each(output)
    finished = [line for line in output.splitlines() if STREAM_LINE.match(line)]
    assert len(finished) == 1, finished
    # The path is in its line, quoted (it holds spaces and "="), every control escaped.
    escaped = (
        "/v1/chat/completions\\r\\n"
        + FORGED
        + "\\u2028FORGED-LS\\x85FORGED-NEL\\x1b[2K\\x7f\\u202e"
    )
    assert f' path="{escaped}" ' in finished[0]
    assert finished[0].count(" end_state=completed") == 2  # the path's, quoted, and the stream's
    assert sum("refused a malformed request" in line for line in output.splitlines()) == 1


async def test_a_path_cannot_forge_a_json_line(any_path_streams: str) -> None:
    output = await sidecar_output(any_path_streams, "json")
    assert_one_line_each(output)
    records = [json.loads(line) for line in output.splitlines()]
    (finished,) = [r for r in records if r["msg"] == "stream finished"]
    # Escaped, not altered: the line decodes to the path exactly.
    assert finished["path"] == PATH
    (request,) = [r for r in records if r["msg"] == "request"]
    assert request["path"] == PATH


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_other_libraries_lines_are_escaped_and_formatted_as_ours(
    capfd: pytest.CaptureFixture[str], log_format: str
) -> None:
    """aiohttp's and asyncio's lines in ``streamwarden run`` go through the same formatter.

    Without a handler of their own Python prints them raw (its last
    resort): a line feed in an exception's message writes a line of its own.
    """
    from streamwarden.config import load_settings
    from streamwarden.observation.logs import configure_logging

    root, ours = logging.getLogger(), logging.getLogger("streamwarden")
    saved = (root.handlers[:], root.level, ours.handlers[:], ours.level, ours.propagate)
    forged = '1.2.3.4\n{"logger": "forged"}\n2026-01-01 00:00:00,000 ERROR forged: x'
    try:
        configure_logging(load_settings(environ={}, overrides={"log_format": log_format}))
        logging.getLogger("aiohttp.server").error("Error handling request from %s", forged)
        logging.getLogger("asyncio").warning("Task was destroyed \x1b[2K\u2028")
        logging.getLogger("aiohttp.access").info("below WARNING: not written")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        ours.handlers[:], ours.level, ours.propagate = saved[2], saved[3], saved[4]
    lines = capfd.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    if log_format == "json":
        records = [json.loads(line) for line in lines]
        assert [r["logger"] for r in records] == ["aiohttp.server", "asyncio"]
        assert records[0]["msg"].endswith(forged)
    else:
        assert " ERROR aiohttp.server: Error handling request from 1.2.3.4\\n{" in lines[0]
        assert " WARNING asyncio: Task was destroyed \\x1b[2K\\u2028" in lines[1]
