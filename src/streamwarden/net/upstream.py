"""streamwarden's own HTTP/1.1 client to an upstream: connections and their pool.

The sidecar's, for its one upstream (its modules import it as
:mod:`streamwarden.net.upstream`), and the probe's
(:mod:`streamwarden.tools.probe.client`), which times each network read with it.
It lives outside the sidecar so that a tool can use it without importing
the face: it needs no web framework, only asyncio and ``httptools``.

Why not aiohttp's client: its pool hands out a connection whose protocol
has already buffered bytes, so an upstream that writes an unsolicited
response on an idle keep-alive connection makes the next client receive
it, and the one after that the previous client's answer. Its body reaches
a relay through a ``StreamReader`` queue, a future and a task wake-up per
read, which was most of the sidecar's CPU per event. Here:

- one :class:`UpstreamConnection` (an ``asyncio.Protocol``) per socket owns
  an ``httptools`` response parser (llhttp, the parser uvicorn uses). Its
  body callback hands each parsed chunk straight to the response's
  :class:`BodySink` inside ``data_received``; nothing is queued in between.
  While the parser stands between two chunks, a read of whole plain chunks
  (the usual one event per read) is read here without it, and it goes on
  from the first byte not taken;
- :class:`UpstreamPool` keeps idle connections (LIFO, bounded in number,
  each closed after ``upstream_keepalive_timeout``) and hands out only those
  that have been silent since their last response ended cleanly. A
  connection that receives any byte while idle, whose response did not end
  cleanly (truncated, malformed, read to close), whose request body was not
  sent whole, or whose response was cancelled, is closed, never reused. No
  client can ever receive bytes meant for another.

Interim ``1xx`` responses are skipped (``Expect`` is never forwarded: the
sidecar answers the client's ``100-continue`` itself). ``HEAD``, ``204`` and
``304`` responses have no body; a response with neither ``Content-Length``
nor chunked encoding is read until the upstream closes, and that close is
its clean end. Chunked trailers are parsed and ignored.

Errors are this module's own (:class:`UpstreamError` and its subclasses),
mapped from OS, TLS and parser errors here and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

if TYPE_CHECKING:
    # A machine integer in the compiled build (a plain int otherwise): the
    # read of a chunk's size line keeps its indexes unboxed.
    from mypy_extensions import i64

__all__ = [
    "BodySink",
    "BodyTooLarge",
    "ClientBodyBroken",
    "Exchange",
    "HeadTimeout",
    "NativeSink",
    "Origin",
    "RequestBody",
    "ResponseHead",
    "UpstreamBroken",
    "UpstreamConnection",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamUnreachable",
    "open_exchange",
    "request_head",
]


class UpstreamError(Exception):
    """The upstream exchange failed; the message names no header value or URL query."""


class UpstreamUnreachable(UpstreamError):
    """No connection could be opened (refused, DNS, TLS handshake, connect timeout)."""


class HeadTimeout(UpstreamError):
    """The upstream did not send its response head within ``upstream_headers_timeout``."""


class UpstreamBroken(UpstreamError):
    """The connection broke or the upstream sent bytes that are not a valid response."""


class BodySink(Protocol):
    """Where a response body goes, called from the connection's ``data_received``."""

    def body(self, chunk: bytes) -> None:
        """A parsed piece of the body (chunked framing removed)."""

    def read_done(self) -> None:
        """One socket read has been parsed: write out what it produced."""

    def body_end(self) -> None:
        """The body ended cleanly."""

    def body_broken(self, error: UpstreamError) -> None:
        """The body ended unclean (cut, reset, malformed)."""


class NativeSink:
    """A :class:`BodySink` the connection calls without a method lookup.

    The sidecar's own sinks derive from it: in the compiled build each call
    is then a direct one, where a call on a protocol looks the method up by
    name (about 500 instructions, twice per event: ``body`` and
    ``read_done``). Any other sink is called through :class:`_Forwarding`.
    """

    __slots__ = ()

    def body(self, chunk: bytes) -> None:
        raise NotImplementedError

    def body_as_read(self, chunk: bytes, read: bytes) -> None:
        """``chunk``, the one chunk of a read whose bytes, ``read``, frame it as a writer would.

        ``read`` is the size in lower-case hex with no leading zero, CRLF,
        ``chunk``, CRLF: what a sink that frames ``chunk`` again for a
        chunked client would write, so it may write ``read`` as it is and
        spare the copy. Otherwise it is :meth:`body`.
        """
        self.body(chunk)

    def read_done(self) -> None:
        raise NotImplementedError

    def body_end(self) -> None:
        raise NotImplementedError

    def body_broken(self, error: UpstreamError) -> None:
        raise NotImplementedError


class _Forwarding(NativeSink):
    """Any other :class:`BodySink`, behind the interface the connection calls."""

    __slots__ = ("_sink",)

    def __init__(self, sink: BodySink) -> None:
        self._sink = sink

    def body(self, chunk: bytes) -> None:
        self._sink.body(chunk)

    def read_done(self) -> None:
        self._sink.read_done()

    def body_end(self) -> None:
        self._sink.body_end()

    def body_broken(self, error: UpstreamError) -> None:
        self._sink.body_broken(error)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The status line and headers of the upstream's final (non-1xx) response."""

    status: int
    reason: str
    headers: CIMultiDictProxy[str]


#: The headers of a head that went on already (:meth:`Exchange.head_relayed`).
_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())

# A connection's life: idle in the pool, or carrying one exchange.
# (Final: the compiled build inlines them; each read tests the state.)
_IDLE: Final = 0
_AWAITING_HEAD: Final = 1
_BODY: Final = 2
_COMPLETE: Final = 3
_CLOSED: Final = 4

_CONNECT_ERRORS = (OSError, ssl.SSLError, TimeoutError)


# Field values may hold HTAB and visible bytes (RFC 9110 section 5.5);
# anything else below 0x20, and DEL, is refused rather than forwarded.
_CONTROL_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _has_control_bytes(value: bytes) -> bool:
    return _CONTROL_BYTE.search(value) is not None


#: Hex digits a chunk's size may have to be read here rather than by the
#: parser (a size of 4 GiB and over is the parser's, which knows the limits).
_SIZE_DIGITS: Final = 8
#: What sets a new parser between two chunks of a chunked body.
_CHUNKED_HEAD: Final = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
_CR: Final = 13
_LF: Final = 10


def _chunk_head(data: bytes, pos: int) -> tuple[int, int]:
    """The size of the chunk whose size line starts at ``pos``, and where its data starts.

    ``(0, -1)`` unless the line is plain, as nearly every streaming server
    writes it: hex digits, then CRLF. Extensions, spaces, an overlong size
    or a line the read cut short are the parser's.
    """
    n: i64 = len(data)
    size: i64 = 0
    i: i64 = pos
    limit: i64 = min(n, i + _SIZE_DIGITS)
    while i < limit:
        digit = _hex_digit(data[i])
        if digit < 0:
            break
        size = size * 16 + digit
        i += 1
    if i == pos or i + 1 >= n or data[i] != _CR or data[i + 1] != _LF:
        return 0, -1
    return size, i + 2


def _as_written(data: bytes, size_end: i64) -> bool:
    """The size line up to ``size_end`` is ``%x``: lower-case hex, no leading zero."""
    if data[0] == 0x30:
        return False
    i: i64 = 0
    while i < size_end:
        if 0x41 <= data[i] <= 0x46:  # A-F
            return False
        i += 1
    return True


def _hex_digit(byte: i64) -> i64:
    if 0x30 <= byte <= 0x39:  # 0-9
        return byte - 0x30
    if 0x61 <= byte <= 0x66:  # a-f
        return byte - 0x57
    if 0x41 <= byte <= 0x46:  # A-F
        return byte - 0x37
    return -1


class UpstreamConnection(asyncio.Protocol):
    """One connection to the upstream, carrying one exchange at a time."""

    # A thousand idle streams hold a thousand of these: no __dict__.
    __slots__ = (
        "_chunk_done",
        "_chunk_edge",
        "_drain",
        "_early",
        "_early_end",
        "_gone",
        "_head",
        "_head_error",
        "_head_only",
        "_idle_timer",
        "_keep_alive",
        "_loop",
        "_lost",
        "_parser",
        "_pool",
        "_raw_headers",
        "_read_to_close",
        "_reading_paused",
        "_reason",
        "_replaying",
        "_sink",
        "_state",
        "_status",
        "_write_paused",
        "answered",
        "exchanges",
        "made",
        "request_sent",
        "transport",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._state = _IDLE
        self._parser: httptools.HttpResponseParser | None = None
        self._head: asyncio.Future[ResponseHead] | None = None
        self._status = 0
        self._reason = b""
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_error: UpstreamError | None = None
        self._sink: NativeSink | None = None
        #: Body bytes parsed before a sink was attached (one read at most:
        #: reading is paused from the head until the sink comes).
        self._early: list[bytes] = []
        self._early_end: UpstreamError | bool = False
        self._head_only = False
        self._read_to_close = False
        self._keep_alive = False
        self._reading_paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        #: The parser stands at the start of a chunk's size line, holding
        #: nothing: a read of whole plain chunks can skip it (see
        #: :meth:`_take_whole_chunks`), and the parser itself is let go.
        #: ``_chunk_done``: the parser's last callback in the current read
        #: was a chunk's end, or the head of a plainly chunked body.
        self._chunk_edge = False
        self._chunk_done = False
        #: The parser is being set between chunks (see :meth:`_parser_between_chunks`).
        self._replaying = False
        #: Exchanges carried so far (a reused connection may have gone stale).
        self.exchanges = 0
        #: Whether any byte of the current exchange's response has arrived.
        self.answered = False
        #: The request (head and body) was written whole.
        self.request_sent = False
        # Both futures are made only while someone waits on them: a pooled
        # connection lives as long as its stream, and two futures were a
        # quarter of a KiB of every idle stream.
        self._lost: asyncio.Future[None] | None = None
        self._gone = False
        #: Done once ``connection_made`` ran (uvloop may run it a turn after
        #: ``create_connection`` returns); ``None`` once the pool has seen it.
        self.made: asyncio.Future[None] | None = self._loop.create_future()

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        made = self.made
        if made is not None and not made.done():
            made.set_result(None)

    @property
    def lost(self) -> asyncio.Future[None]:
        """Done once the connection is closed."""
        if self._lost is None:
            self._lost = self._loop.create_future()
            if self._gone:
                self._lost.set_result(None)
        return self._lost

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE or self._state == _COMPLETE:
            # Bytes nobody asked for: an unsolicited response, or a stray
            # byte after the last one. Whatever they are, this connection can
            # no longer be trusted to frame the next answer.
            self.close()
            return
        if self._state == _CLOSED:
            return
        self.answered = True
        if self._chunk_edge and self._sink is not None:
            taken = self._take_whole_chunks(data)
            if taken < len(data) and self._state == _BODY:
                self._parse(data[taken:] if taken else data)
        else:
            self._parse(data)
        sink = self._sink
        if sink is not None:
            sink.read_done()

    def _parse(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:
            parser = self._parser_between_chunks()
        self._chunk_edge = False
        self._chunk_done = False
        try:
            parser.feed_data(data)
            # After a chunk's end (or a chunked body's head) only a size
            # line can follow, and a size line that ends in CRLF is a
            # chunk's head (a callback) or an error: a read that ends in
            # CRLF right after either leaves the parser holding nothing.
            # Only in the final response's body: an interim (1xx) answer's
            # own chunks leave the parser inside that answer.
            self._chunk_edge = self._chunk_done and self._state == _BODY and data.endswith(b"\r\n")
            if self._chunk_edge:
                # Between chunks llhttp holds nothing the next read needs:
                # an idle stream keeps 0.9 KiB less without it, and the
                # read that needs it again makes it anew.
                self._parser = None
        except httptools.HttpParserCallbackError:
            self._fail(self._head_error or UpstreamBroken("the upstream response was refused"))
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBroken("the upstream switched protocols unasked"))
        except httptools.HttpParserError:
            self._fail(UpstreamBroken("the upstream sent a malformed response"))

    def _parser_between_chunks(self) -> httptools.HttpResponseParser:
        """A parser that stands where the one let go stood: between two chunks.

        It reads a head that says only "chunked" (its callbacks change
        nothing: the head that counts was read), and is then where a parser
        is after a chunk's end or after the head of a chunked body.
        """
        parser = httptools.HttpResponseParser(self)
        self._replaying = True
        try:
            parser.feed_data(_CHUNKED_HEAD)
        finally:
            self._replaying = False
        self._parser = parser
        return parser

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost tells what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        self._state = _CLOSED
        self._cancel_idle_timer()
        self._pool.forget(self)
        if state == _BODY and self._read_to_close and exc is None:
            self._finish_body()
        elif state in (_AWAITING_HEAD, _BODY):
            what = "reset" if exc is not None else "closed"
            self._fail(UpstreamBroken(f"the upstream connection was {what} mid-response"))
        waiter = self._drain
        if waiter is not None and not waiter.done():
            waiter.set_exception(UpstreamBroken("the upstream connection closed"))
        self._gone = True
        lost = self._lost
        if lost is not None and not lost.done():
            lost.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- httptools callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        if self._replaying:
            return
        if self._state == _COMPLETE:
            self._poison()
        self._raw_headers = []
        self._reason = b""

    def on_status(self, reason: bytes) -> None:
        if not self._replaying:
            self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._replaying:
            return
        if _has_control_bytes(name) or _has_control_bytes(value):
            self._head_error = UpstreamBroken("the upstream sent a header with a control byte")
            raise self._head_error
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._replaying:
            return
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if 100 <= status < 200:
            return  # interim (100 Continue, 103 Early Hints): the final one follows
        if self._state != _AWAITING_HEAD:
            self._head_error = UpstreamBroken("the upstream sent a second response")
            raise self._head_error
        headers: CIMultiDict[str] = CIMultiDict(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in self._raw_headers
        )
        self._raw_headers = []
        self._status = status
        self._keep_alive = parser.should_keep_alive()
        no_body = self._head_only or status in (204, 304)
        coding = headers.get("transfer-encoding", "")
        self._read_to_close = (
            not no_body and "content-length" not in headers and "chunked" not in coding.lower()
        )
        self._state = _BODY
        # A body llhttp reads as chunked, plainly said: the parser stands
        # before its first chunk as it does after a chunk's end. (Only
        # spaces and tabs around the value: ``str.strip`` would also take
        # the latin-1 NEL and no-break space, which llhttp keeps.)
        self._chunk_done = (
            not no_body
            and coding.isascii()
            and coding.strip(" \t").lower() == "chunked"
            and len(headers.getall("transfer-encoding", ())) == 1
            and "content-length" not in headers
        )
        head = ResponseHead(status, self._reason.decode("latin-1"), CIMultiDictProxy(headers))
        waiter = self._head
        if waiter is not None and not waiter.done():
            waiter.set_result(head)
        if self._sink is None:
            # The sink comes on the next loop turn: hold what the rest of this
            # read brings, and read no more until then.
            self.pause_reading()
        if self._head_only:
            # llhttp cannot be told that this answers a HEAD and waits for the
            # body the headers describe: the exchange ends here, and any byte
            # that follows (parsed as that body) poisons the connection.
            self._finish_body()

    def on_body(self, body: bytes) -> None:
        if self._state != _BODY:
            if self._state == _COMPLETE:
                self._poison()  # bytes after a HEAD answer's head
            return
        sink = self._sink
        if sink is not None:
            sink.body(body)
        else:
            self._early.append(body)

    def on_chunk_header(self) -> None:
        self._chunk_done = False

    def on_chunk_complete(self) -> None:
        self._chunk_done = True

    def on_message_complete(self) -> None:
        self._chunk_done = False
        if self._state == _BODY:
            self._finish_body()

    def _take_whole_chunks(self, data: bytes) -> int:
        """Give the sink the whole plain chunks ``data`` starts with; how many bytes they took.

        Only while the parser stands between chunks: what it has not seen
        leaves it where it stands, so it goes on from the first byte not
        taken here (a cut or unusual chunk, the last chunk and its trailers).
        Reading a whole chunk here costs about a third of what the parser's
        call, its callback and the method lookup did (README, Speed).
        """
        n = len(data)
        pos = 0
        while pos < n:
            size, start = _chunk_head(data, pos)
            end = start + size
            if start < 0 or size == 0 or end + 2 > n or data[end] != _CR or data[end + 1] != _LF:
                break  # the last chunk, or one this read does not hold whole
            sink = self._sink
            if sink is None or self._state != _BODY:
                break
            try:
                if pos == 0 and end + 2 == n and _as_written(data, start - 2):
                    # The read is this one chunk, framed as the client's would be.
                    sink.body_as_read(data[start:end], data)
                else:
                    sink.body(data[start:end])
            except BaseException:
                # As a sink's error inside the parser's callback ends:
                # httptools catches any exception there.
                self._fail(self._head_error or UpstreamBroken("the upstream response was refused"))
                return n
            pos = end + 2
        return pos

    # -- the exchange ----------------------------------------------------------

    def begin(self, head: bytes, *, head_only: bool) -> asyncio.Future[ResponseHead]:
        """Start an exchange: write the request head; the future gets the response head."""
        assert self._state == _IDLE and self.transport is not None
        self._cancel_idle_timer()
        self.exchanges += 1
        self._state = _AWAITING_HEAD
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = head_only
        self._head_error = None
        self._chunk_edge = False
        self._sink = None
        self._early = []
        self._early_end = False
        self.answered = False
        self.request_sent = False
        self._head = self._loop.create_future()
        self.transport.write(head)
        return self._head

    def write(self, data: bytes) -> None:
        """Write request body bytes (already framed)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        """Until the upstream has taken our writes down to its low-water mark."""
        if self._state == _CLOSED:
            raise UpstreamBroken("the upstream connection closed")
        if not self._write_paused:
            return
        self._drain = self._loop.create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def attach(self, sink: BodySink) -> None:
        """Send the body to ``sink`` from now on (and what came before it, at once)."""
        if not isinstance(sink, NativeSink):
            sink = _Forwarding(sink)
        self._sink = sink
        self._head = None  # answered: a failure from now on is the sink's to hear
        early, self._early = self._early, []
        for chunk in early:
            sink.body(chunk)
        if early:
            sink.read_done()
        ended = self._early_end
        if ended is True:
            sink.body_end()
        elif isinstance(ended, UpstreamError):
            sink.body_broken(ended)
        else:
            self.resume_reading()

    def pause_reading(self) -> None:
        """Stop reading the upstream (its sender blocks once the socket buffers fill)."""
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and self._state != _CLOSED:
            self._reading_paused = False
            self.transport.resume_reading()

    @property
    def reusable(self) -> bool:
        return (
            self._state == _COMPLETE
            and self._keep_alive
            and self.request_sent
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def release(self) -> None:
        """The exchange is over: back to the pool if it ended cleanly, else closed."""
        self._sink = None
        self._head = None
        if self.reusable:
            self._state = _IDLE
            self._parser = None
            self.resume_reading()  # an idle connection must see stray bytes at once
            self._pool.put(self)
        else:
            self.close()

    def hang_up(self) -> None:
        """Close now, FIN first: the client left and the upstream must stop generating.

        ``transport.abort()`` closes the socket on the loop's next turn;
        ``shutdown`` sends the FIN in this callback (cancel propagation p99
        went from about 1 ms to under 0.5 ms with it, bench/README.md).
        """
        transport = self.transport
        if transport is None or self._state == _CLOSED:
            return
        sock = transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if fd >= 0:
            # uvloop's transport sockets refuse shutdown(): borrow the descriptor.
            borrowed = socket.socket(fileno=fd)
            try:
                borrowed.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone
            finally:
                borrowed.detach()  # the transport still owns it and closes it
        self.close()

    def close(self) -> None:
        if self._state in (_AWAITING_HEAD, _BODY):
            self._fail(UpstreamBroken("the upstream exchange was abandoned"))
        self._state = _CLOSED
        self._cancel_idle_timer()
        self._pool.forget(self)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    # -- internals -------------------------------------------------------------

    def _poison(self) -> None:
        """Bytes arrived that no request asked for: never reuse this connection."""
        self._keep_alive = False
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.abort()

    def _finish_body(self) -> None:
        if self._state == _BODY:
            self._state = _COMPLETE
        sink = self._sink
        if sink is not None:
            sink.body_end()
        else:
            self._early_end = True

    def _fail(self, error: UpstreamError) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.abort()
        if self._state == _COMPLETE:
            # The response ended whole; whatever came after it only means the
            # connection cannot be trusted again.
            self._keep_alive = False
            return
        self._state = _CLOSED
        waiter = self._head
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
            waiter.exception()  # whoever awaits still gets it; nobody may (cancelled)
            return
        sink = self._sink
        if sink is not None:
            self._sink = None
            sink.body_broken(error)
        elif self._early_end is False and self._head is not None:
            self._early_end = error

    def _cancel_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def arm_idle_timer(self, seconds: float) -> None:
        self._cancel_idle_timer()
        if seconds > 0:
            self._idle_timer = self._loop.call_later(seconds, self.close)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the upstream is: ``http``/``https`` host and port, or a unix socket."""

    scheme: str
    host: str
    port: int
    unix_path: str | None = None

    @property
    def host_header(self) -> str:
        if self.unix_path is not None:
            return "localhost"
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class UpstreamPool:
    """The upstream's connections: idle ones kept for reuse, new ones opened on demand."""

    def __init__(
        self,
        origin: Origin,
        *,
        connect_timeout: float,
        keepalive_timeout: float,
        max_idle: int,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.origin = origin
        self._connect_timeout = connect_timeout
        self._keepalive_timeout = keepalive_timeout
        self._max_idle = max_idle
        self._ssl = ssl_context
        self._idle: collections.deque[UpstreamConnection] = collections.deque()
        #: Connections carrying an exchange (for the leak tests and /streams).
        self.busy: set[UpstreamConnection] = set()
        self._closed = False

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    async def acquire(self) -> UpstreamConnection:
        """An idle connection that has been silent since its last response, or a new one."""
        if self._closed:
            raise UpstreamUnreachable("the sidecar is closing")
        while self._idle:
            connection = self._idle.pop()  # the most recently used: least likely stale
            transport = connection.transport
            if transport is None or transport.is_closing():
                continue
            self.busy.add(connection)
            return connection
        connection = await self._connect()
        self.busy.add(connection)
        return connection

    def put(self, connection: UpstreamConnection) -> None:
        self.busy.discard(connection)
        if self._closed or len(self._idle) >= self._max_idle:
            connection.close()
            return
        connection.arm_idle_timer(self._keepalive_timeout)
        self._idle.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        """A connection closed: it is neither idle nor busy any more."""
        self.busy.discard(connection)
        with contextlib.suppress(ValueError):
            self._idle.remove(connection)

    async def close(self) -> None:
        self._closed = True
        connections = [*self._idle, *self.busy]
        for connection in connections:
            connection.close()
        if connections:
            await asyncio.wait([c.lost for c in connections], timeout=1.0)

    async def _connect(self) -> UpstreamConnection:
        origin = self.origin
        factory: Callable[[], UpstreamConnection] = lambda: UpstreamConnection(self)  # noqa: E731
        try:
            async with asyncio.timeout(self._connect_timeout or None):
                if origin.unix_path is not None:
                    _, connection = await self.loop.create_unix_connection(
                        factory, origin.unix_path
                    )
                else:
                    _, connection = await self.loop.create_connection(
                        factory,
                        origin.host,
                        origin.port,
                        ssl=self._ssl,
                        server_hostname=origin.host if self._ssl is not None else None,
                    )
                if connection.made is not None:
                    await connection.made
                connection.made = None
        except TimeoutError:
            raise UpstreamUnreachable("connecting to the upstream timed out") from None
        except ssl.SSLCertVerificationError as exc:
            raise UpstreamUnreachable(
                f"the upstream's certificate was refused ({exc.verify_message})"
            ) from None
        except _CONNECT_ERRORS as exc:
            raise UpstreamUnreachable(
                f"the upstream could not be reached ({type(exc).__name__})"
            ) from None
        return connection


class BodyTooLarge(UpstreamError):
    """The client's request body went past ``max_request_body_bytes``."""


class ClientBodyBroken(UpstreamError):
    """The client's request body could not be read to its end (the client left)."""


@dataclass(slots=True)
class RequestBody:
    """A request body on its way upstream: what was read already, then the rest."""

    #: Bytes already read from the client (to look for ``"stream": true``).
    start: bytes
    #: The rest of the body, de-chunked, or ``None`` if ``start`` is all of it.
    rest: AsyncIterator[bytes] | None
    #: Send with chunked framing (the client sent no ``Content-Length``).
    chunked: bool
    #: Most bytes forwarded before :class:`BodyTooLarge`.
    limit: int


def request_head(method: str, target: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """The request line and header block, as the client's parser gave them to us."""
    lines = [f"{method} {target} HTTP/1.1"]
    lines.extend(f"{name}: {value}" for name, value in headers)
    lines.append("\r\n")
    # aiohttp's server decodes header bytes as UTF-8 with surrogateescape:
    # this gives the client's own bytes back.
    return "\r\n".join(lines).encode("utf-8", "surrogateescape")


class Exchange:
    """One request and its response on one upstream connection."""

    __slots__ = ("_finished", "_sender", "connection", "head")

    def __init__(
        self, connection: UpstreamConnection, head: ResponseHead, sender: asyncio.Task[None] | None
    ) -> None:
        self.connection = connection
        self.head = head
        self._sender = sender
        self._finished = False

    def attach(self, sink: BodySink) -> None:
        self.connection.attach(sink)

    def head_relayed(self) -> None:
        """The head went on to the client: keep its status and reason, not its headers.

        An open stream keeps its exchange, and the headers (with what
        iterating them cached in the multidict) were about 1 KiB of it.
        """
        head = self.head
        self.head = ResponseHead(head.status, head.reason, _NO_HEADERS)

    def finish(self) -> None:
        """Back to the pool if the exchange ended whole on both sides, else closed.

        Once: a second call must not close the connection the first one
        pooled (and that another exchange may already be using).
        """
        if self._finished:
            return
        self._finished = True
        sender = self._sender
        if sender is not None and not sender.done():
            sender.cancel()  # the upload was not finished: request_sent stays False
        self.connection.release()


def _send_part(connection: UpstreamConnection, body: RequestBody, data: bytes) -> None:
    if data:
        connection.write(b"%x\r\n%b\r\n" % (len(data), data) if body.chunked else data)


def _send_whole(connection: UpstreamConnection, body: RequestBody) -> None:
    """Send a body that is wholly in hand (most requests: one JSON object)."""
    if len(body.start) > body.limit:
        raise BodyTooLarge("the request body is too large")
    _send_part(connection, body, body.start)
    if body.chunked:
        connection.write(b"0\r\n\r\n")
    connection.request_sent = True


async def _send_body(connection: UpstreamConnection, body: RequestBody) -> None:
    """Stream the request body upstream, with backpressure both ways.

    The client side is paced by aiohttp's reader (it stops reading the
    client when its buffer fills), the upstream side by ``drain``.
    """
    assert body.rest is not None
    if len(body.start) > body.limit:
        raise BodyTooLarge("the request body is too large")
    _send_part(connection, body, body.start)
    total = len(body.start)
    try:
        async for data in body.rest:
            total += len(data)
            if total > body.limit:
                raise BodyTooLarge("the request body is too large")
            _send_part(connection, body, data)
            await connection.drain()
    except (OSError, RuntimeError) as exc:
        # aiohttp's reader of a client that went away mid-upload.
        raise ClientBodyBroken(type(exc).__name__) from None
    if body.chunked:
        connection.write(b"0\r\n\r\n")
    connection.request_sent = True


async def open_exchange(
    pool: UpstreamPool,
    head: bytes,
    body: RequestBody | None,
    *,
    head_only: bool,
    headers_timeout: float,
    idempotent: bool,
) -> Exchange:
    """Send a request and wait for the upstream's response head.

    A pooled connection can go stale in the instant it is picked (the
    upstream closed it as idle just as the request went out). If one breaks
    before any byte of an answer, the request goes once more on a new
    connection, but only when sending it twice is safe: an idempotent
    method, or an ``Idempotency-Key`` header (RFC draft, as Stripe and
    OpenAI use it), and a body that is wholly in hand. A POST that starts a
    generation is never sent twice (the upstream may have begun it); any
    other failure is the caller's to report.
    """
    replayable = (body is None or body.rest is None) and idempotent
    for attempt in (1, 2):
        connection = await pool.acquire()
        reused = connection.exchanges > 0
        waiter = connection.begin(head, head_only=head_only)
        sender: asyncio.Task[None] | None = None
        try:
            if body is None:
                connection.request_sent = True
            elif body.rest is None:
                _send_whole(connection, body)  # in hand: no task to wait on a drain
            else:
                sender = asyncio.ensure_future(_send_body(connection, body))
            async with asyncio.timeout(headers_timeout or None):
                while sender is not None and not sender.done() and not waiter.done():
                    racing: set[asyncio.Future[object]] = {waiter, sender}  # type: ignore[arg-type]
                    await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
                if sender is not None and sender.done() and not waiter.done():
                    sender.result()  # raises the upload's error, if it failed
                response = await waiter
        except TimeoutError:
            _abandon(connection, sender)
            raise HeadTimeout("the upstream did not answer in time") from None
        except UpstreamBroken:
            _abandon(connection, sender)
            if attempt == 1 and reused and replayable and not connection.answered:
                continue
            raise
        except BaseException:
            _abandon(connection, sender)
            raise
        if sender is not None and sender.done():
            # Sent: nothing left to cancel, and the stream need not keep the task.
            if not sender.cancelled():
                sender.exception()  # a late failure left request_sent False: closed, not pooled
            sender = None
        return Exchange(connection, response, sender)
    raise AssertionError("unreachable")


def _abandon(connection: UpstreamConnection, sender: asyncio.Task[None] | None) -> None:
    if sender is not None and not sender.done():
        sender.cancel()
    elif sender is not None and not sender.cancelled():
        sender.exception()  # retrieved: the caller reports what matters
    connection.close()
