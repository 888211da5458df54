"""The network face of ``streamwarden probe``: one streaming request, every read timed.

It sends the request with the HTTP/1.1 client the sidecar uses
(:mod:`streamwarden.net.upstream`) rather than httpx, because that
client tells where each network read ends: its ``BodySink.read_done`` is
called once per ``data_received``, that is once per ``recv`` from the
socket, after the chunked framing of that read was parsed. httpx's
``iter_raw`` yields one piece per chunk of the chunked encoding, so a read
that carried ten events in ten chunks would look like ten reads, and a hop
that lumps events would look clean. Each read is stamped with the
monotonic clock as it is parsed; the body stays content-coded (the
analysis inflates it) so a hop's compression is seen as it arrived.

Everything else (what the reads mean) is :mod:`streamwarden.tools.probe.measure`'s.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass

from yarl import URL

from streamwarden import __version__
from streamwarden.core.headers import SECRET_HEADERS
from streamwarden.net.upstream import (
    Origin,
    RequestBody,
    UpstreamError,
    UpstreamPool,
    UpstreamUnreachable,
    open_exchange,
    request_head,
)
from streamwarden.tools.probe.measure import Capture, Ending, Read

__all__ = [
    "DEFAULT_BODY",
    "DEFAULT_PATH",
    "ProbeError",
    "ProbeRequest",
    "UsageError",
    "capture",
    "prepare",
]

#: The path a URL without one is sent to (an OpenAI-style API's base URL).
DEFAULT_PATH = "/v1/chat/completions"
#: The request body unless ``--data`` gives one: a chat completion, streamed.
DEFAULT_BODY = {
    "model": "gpt-4o-mini",
    "stream": True,
    "messages": [{"role": "user", "content": "Count from 1 to 40, one number per line."}],
}


class UsageError(ValueError):
    """A bad URL, header or option (exit code 2)."""


class ProbeError(Exception):
    """The probe could not get an answer (the URL could not be reached, no head in time)."""


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """The request a probe sends, ready for the wire."""

    origin: Origin
    method: str
    target: str
    #: The request line for the report: no userinfo, no query values.
    shown_url: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stall: float | None
    max_time: float
    max_bytes: int
    max_events: int
    connect_timeout: float
    ca_bundle: str | None

    def shown_headers(self) -> list[tuple[str, str]]:
        """The headers sent, secrets redacted, for the report."""
        return [
            (name, "[redacted]" if name.lower() in SECRET_HEADERS else value)
            for name, value in self.headers
        ]


def _shown_url(url: URL, path: str | None = None) -> str:
    bare = url.with_user(None).with_password(None).with_query(None).with_fragment(None)
    base = str(bare if path is None else bare.with_path(path, encoded=True))
    if url.query:
        # Names help to read the report; values may be keys (?key=...).
        base += "?" + "&".join(f"{name}=..." for name in url.query)
    return base


def prepare(
    url: str,
    *,
    method: str = "POST",
    headers: Sequence[str] = (),
    data: bytes | None = None,
    stall: float | None = None,
    stamp: bool = True,
    max_time: float = 300.0,
    max_bytes: int = 16 * 1024 * 1024,
    max_events: int = 100_000,
    connect_timeout: float = 10.0,
    ca_bundle: str | None = None,
) -> ProbeRequest:
    """Check the options and build the request; raises :class:`UsageError`."""
    try:
        parsed = URL(url)
    except ValueError:
        raise UsageError(f"URL {url!r} is not a URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise UsageError(f"URL must be http:// or https:// with a host, not {_shown_url(parsed)!r}")
    if not method.isalpha() or not method.isascii():
        raise UsageError(f"--method {method!r}: expected an HTTP method such as POST")
    method = method.upper()
    path = parsed.raw_path
    if path in ("", "/") and data is None:
        path = DEFAULT_PATH
    target = path + (f"?{parsed.raw_query_string}" if parsed.raw_query_string else "")
    body = data if data is not None else json.dumps(DEFAULT_BODY).encode()
    if method in ("GET", "HEAD") and data is None:
        body = b""
    assert parsed.port is not None
    origin = Origin(parsed.scheme, parsed.host, parsed.port)
    defaults = _default_headers(origin, parsed, body, stamp, stall)
    given = _given_headers(headers)
    names = {name.lower() for name, _ in given}
    sent = [(n, v) for n, v in defaults if n.lower() not in names] + given
    sent = [(n, v) for n, v in sent if n.lower() != "content-length"]
    if body or method not in ("GET", "HEAD"):
        sent.append(("Content-Length", str(len(body))))
    if max_bytes < 1 or max_events < 1:
        raise UsageError("--max-bytes and --max-events must be at least 1")
    if stall is not None and max_time <= stall:
        raise UsageError(f"--max-time must be longer than --stall ({stall:g}s)")
    return ProbeRequest(
        origin=origin,
        method=method,
        target=target,
        shown_url=_shown_url(parsed, path),
        headers=tuple(sent),
        body=body,
        stall=stall,
        max_time=max_time,
        max_bytes=max_bytes,
        max_events=max_events,
        connect_timeout=connect_timeout,
        ca_bundle=ca_bundle,
    )


def _given_headers(headers: Sequence[str]) -> list[tuple[str, str]]:
    """The ``-H 'Name: value'`` flags as headers; raises :class:`UsageError`."""
    given: list[tuple[str, str]] = []
    for header in headers:
        name, sep, value = header.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name or not all(c.isalnum() or c in "-_!#$%&'*+.^`|~" for c in name):
            raise UsageError(f"-H {name or header!r}: expected 'Name: value'")
        if any(c in value for c in "\r\n\x00"):
            raise UsageError(f"-H {name}: the value holds a line break")
        given.append((name, value))
    return given


def _default_headers(
    origin: Origin, parsed: URL, body: bytes, stamp: bool, stall: float | None
) -> list[tuple[str, str]]:
    """The headers the probe sends unless a ``-H`` flag gives its own."""
    defaults: list[tuple[str, str]] = [
        ("Host", origin.host_header),
        ("User-Agent", f"streamwarden-probe/{__version__}"),
        ("Accept", "text/event-stream"),
        # What browsers send: a hop that compresses event streams shows itself.
        ("Accept-Encoding", "gzip, deflate"),
    ]
    if body:
        defaults.append(("Content-Type", "application/json"))
    if parsed.user is not None:
        token = f"{parsed.user}:{parsed.password or ''}".encode()
        defaults.append(("Authorization", "Basic " + base64.b64encode(token).decode()))
    if stamp:
        # The mock's controls: headers survive any proxy that forwards them.
        defaults.append(("x-mock-stamp", "1"))
    if stall is not None:
        defaults += [("x-mock-fault", "stall"), ("x-mock-delay", f"{stall:g}")]
    return defaults


class _Recorder:
    """A ``BodySink`` that keeps each network read with its arrival time."""

    def __init__(self, started: float, max_bytes: int) -> None:
        self._started = started
        self._max_bytes = max_bytes
        self._pending: list[bytes] = []
        self._total = 0
        self.reads: list[Read] = []
        self.ending: Ending | None = None
        self.ended_at = 0.0
        self.error: str | None = None
        self.finished = asyncio.get_running_loop().create_future()

    def body(self, chunk: bytes) -> None:
        if self.ending is None:
            self._pending.append(chunk)

    def read_done(self) -> None:
        if not self._pending or self.ending is not None:
            return
        data = b"".join(self._pending)
        self._pending = []
        self.reads.append(Read(time.monotonic() - self._started, data))
        self._total += len(data)
        if self._total >= self._max_bytes:
            self._finish(Ending.TOO_LARGE)

    def body_end(self) -> None:
        self.read_done()  # llhttp ends the message inside the read that carried its end
        self._finish(Ending.COMPLETE)

    def body_broken(self, error: UpstreamError) -> None:
        self.read_done()
        self.error = str(error)
        self._finish(Ending.BROKEN)

    def give_up(self) -> None:
        """``max_time`` ran out: keep what arrived, mark the stream as still open."""
        self.read_done()
        self._finish(Ending.GAVE_UP)

    def _finish(self, ending: Ending) -> None:
        if self.ending is None:
            self.ending = ending
            self.ended_at = time.monotonic() - self._started
            if not self.finished.done():
                self.finished.set_result(None)


async def capture(request: ProbeRequest, *, dialect: str = "auto") -> Capture:
    """Send the request and record the answer until it ends or ``max_time`` runs out."""
    context: ssl.SSLContext | None = None
    if request.origin.scheme == "https":
        context = ssl.create_default_context(cafile=request.ca_bundle)
    pool = UpstreamPool(
        request.origin,
        connect_timeout=request.connect_timeout,
        keepalive_timeout=0.0,
        max_idle=0,
        ssl_context=context,
    )
    started = time.monotonic()
    started_wall = time.time()
    try:
        head = request_head(request.method, request.target, request.headers)
        body = RequestBody(start=request.body, rest=None, chunked=False, limit=len(request.body))
        try:
            exchange = await open_exchange(
                pool,
                head,
                body if request.body else None,
                head_only=request.method == "HEAD",
                headers_timeout=request.max_time,
                idempotent=False,
            )
        except UpstreamUnreachable as exc:
            raise ProbeError(f"{request.shown_url}: {exc}") from None
        except UpstreamError as exc:
            raise ProbeError(f"{request.shown_url}: {exc}") from None
        headers_at = time.monotonic() - started
        recorder = _Recorder(started, request.max_bytes)
        exchange.attach(recorder)
        try:
            remaining = max(request.max_time - headers_at, 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(recorder.finished), remaining)
            recorder.give_up()
        finally:
            exchange.finish()
        response = exchange.head
        return Capture(
            status=response.status,
            headers=tuple(response.headers.items()),
            headers_at=headers_at,
            reads=tuple(recorder.reads),
            ending=recorder.ending or Ending.GAVE_UP,
            ended_at=recorder.ended_at,
            started_wall=started_wall,
            path=URL(request.target).path if request.target.startswith("/") else "/",
            dialect=dialect,
            stall=request.stall,
            error=recorder.error,
            max_bytes=request.max_bytes,
            max_events=request.max_events,
        )
    finally:
        await pool.close()
