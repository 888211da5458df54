"""Whole chunks read without the HTTP parser: the same body as the parser's, bytes for bytes.

Between two chunks of a chunked response, a read made of whole plain chunks
(hex size, CRLF, data, CRLF) is handed to the sink without going through
httptools (``UpstreamConnection._take_whole_chunks``); anything else goes to
the parser, which stands where the last whole chunk left it. Each example
here drives a real :class:`UpstreamConnection` on a real socket with the
bytes of a response cut into reads at hostile places, and compares what its
sink receives with what llhttp alone makes of the same bytes: the body, and
whether the response ended or broke. Responses are plain, unusual (chunk
extensions, upper-case and zero-padded sizes, trailers) or corrupted (a
byte changed, a cut, bytes after the end).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamwarden.net.upstream import (
    _CHUNKED_HEAD,
    Origin,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@dataclass
class Heard:
    """What a sink (or llhttp alone) made of a response."""

    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    broken: bool = False


class RecordingSink:
    def __init__(self) -> None:
        self.heard = Heard()
        self.reads = 0

    def body(self, chunk: bytes) -> None:
        self.heard.body += chunk

    def read_done(self) -> None:
        self.reads += 1

    def body_end(self) -> None:
        self.heard.ended = True

    def body_broken(self, error: UpstreamError) -> None:
        self.heard.broken = True


class Counting:
    """Bytes given to llhttp parsers while it is in place (the short way's bytes are not)."""

    def __init__(self) -> None:
        self.fed = 0


@contextlib.contextmanager
def counting_parsers() -> Iterator[Counting]:
    counting = Counting()
    original = httptools.HttpResponseParser

    class CountingParser(original):  # type: ignore[misc, valid-type]
        def feed_data(self, data: bytes) -> None:
            if data != _CHUNKED_HEAD:  # not what sets a new parser between chunks
                counting.fed += len(data)
            super().feed_data(data)

    httptools.HttpResponseParser = CountingParser
    try:
        yield counting
    finally:
        httptools.HttpResponseParser = original


def llhttp_alone(response: bytes) -> Heard:
    """What llhttp reads from ``response`` in one parser, interim (1xx) answers skipped."""
    heard = Heard()
    parser: httptools.HttpResponseParser

    class Callbacks:
        def on_body(self, body: bytes) -> None:
            if parser.get_status_code() >= 200:  # an interim answer's body is no one's
                heard.body += body

        def on_message_complete(self) -> None:
            if parser.get_status_code() >= 200:
                heard.ended = True

    parser = httptools.HttpResponseParser(Callbacks())
    try:
        parser.feed_data(response)
    except httptools.HttpParserError:
        heard.broken = True
    return heard


def assert_heard_as_llhttp_reads(heard: Heard, response: bytes) -> None:
    """The same body and the same end as llhttp alone gives ``response``."""
    alone = llhttp_alone(response)
    assert bytes(heard.body) == bytes(alone.body)
    assert heard.ended == alone.ended
    # Bytes after a whole response only poison the connection: the response stands.
    assert heard.broken == (not alone.ended)


async def through_the_connection(
    reads: list[bytes], after_each: Callable[[UpstreamConnection], object] | None = None
) -> Heard:
    """Each of ``reads`` as one ``data_received`` of a real connection, as the loop would."""
    pool = UpstreamPool(
        Origin("http", "127.0.0.1", 1),
        connect_timeout=1.0,
        keepalive_timeout=1.0,
        max_idle=1,
        ssl_context=None,
    )
    ours, theirs = socket.socketpair()
    try:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: UpstreamConnection(pool), sock=ours)
        head = connection.begin(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", head_only=False)
        sink = RecordingSink()
        for data in reads:
            connection.data_received(data)
            if head.done() and connection._sink is None and not head.exception():
                connection.attach(sink)  # as the exchange does once it has the head
            if after_each is not None:
                after_each(connection)
        if connection._state < 3:  # still open: the upstream closes it
            connection.connection_lost(None)
        if not head.done():
            head.cancel()
        elif head.exception() is not None:
            sink.heard.broken = True
        return sink.heard
    finally:
        theirs.close()
        await pool.close()


def run(
    reads: list[bytes], after_each: Callable[[UpstreamConnection], object] | None = None
) -> tuple[Heard, Counting]:
    with counting_parsers() as counting:
        heard = asyncio.run(through_the_connection(reads, after_each))
    return heard, counting


def cut(response: bytes, places: list[int]) -> list[bytes]:
    edges = sorted({p % (len(response) + 1) for p in places} | {0, len(response)})
    return [response[a:b] for a, b in itertools.pairwise(edges) if b > a]


#: Pieces that look like chunked framing: a chunk's data made of them looks
#: like chunks to a reader that loses its place.
FRAMING = [b"\r\n", b"\r", b"\n", b"0", b"1", b"5", b"a", b"F", b"g", b";", b" ", b"3\r\nabc\r\n"]


@st.composite
def chunk_data(draw: st.DrawFn) -> bytes:
    pieces = st.one_of(st.sampled_from(FRAMING), st.binary(min_size=1, max_size=6))
    return b"".join(draw(st.lists(pieces, min_size=1, max_size=16)))


@st.composite
def chunks(draw: st.DrawFn) -> bytes:
    data = draw(chunk_data())
    # A size that lies by a byte or two: the data's CRLF is not where it says.
    size = max(1, len(data) + draw(st.sampled_from([0, 0, 0, 0, -2, -1, 1, 2])))
    digits = format(size, draw(st.sampled_from(["x", "X"])))
    digits = "0" * draw(st.sampled_from([0, 0, 0, 1, 9])) + digits
    extension = draw(st.sampled_from(["", "", "", "", ";a=b", ';q="x y"', " ", "\t"]))
    return digits.encode() + extension.encode() + b"\r\n" + data + b"\r\n"


#: Heads of chunked responses: plainly said, and said in ways the short way leaves alone.
HEADS = [
    HEAD,
    HEAD,
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked \r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",  # read to the close
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" + HEAD,
    # Not chunked to llhttp (a no-break space is part of the value): read to the close.
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\xa0\r\n\r\n",
    # An interim answer with chunks of its own, then the final one.
    b"HTTP/1.1 150 X\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n" + HEAD,
]


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    head = draw(st.sampled_from(HEADS))
    body = b"".join(draw(st.lists(chunks(), max_size=10)))
    ends = [b"0\r\n\r\n", b"0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n", b"000\r\n\r\n"]
    end = draw(st.sampled_from(ends))
    response = head + body + end
    damage = draw(st.sampled_from(["none", "none", "byte", "byte", "insert", "cut", "after"]))
    if damage in ("byte", "insert"):
        place = draw(st.integers(len(head), len(response) - 1))
        value = draw(st.sampled_from(FRAMING))
        response = response[:place] + value + response[place + (damage == "byte") :]
    elif damage == "cut":
        response = response[: draw(st.integers(len(head), len(response) - 1))]
    elif damage == "after":
        response += draw(st.sampled_from([b"5\r\nhello\r\n", b"\r\n", b"HTTP/1.1 200 OK\r\n"]))
    return response


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.integers(0, 10_000), max_size=12))
def test_the_sink_hears_what_llhttp_alone_makes_of_any_response_cut_anywhere(
    response: bytes, places: list[int]
) -> None:
    heard, _ = run(cut(response, places))
    assert_heard_as_llhttp_reads(heard, response)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.one_of(chunks(), st.sampled_from(FRAMING)), min_size=1, max_size=8),
    st.lists(st.integers(0, 10_000), max_size=4),
)
def test_after_a_whole_chunk_any_bytes_cut_anywhere_are_read_as_llhttp_reads_them(
    pieces: list[bytes], places: list[int]
) -> None:
    """The parser stands between chunks after the first read: every later read
    starts with the short way, whatever its bytes look like."""
    rest = b"".join(pieces) + b"0\r\n\r\n"
    first = HEAD + b"2\r\nhi\r\n"
    heard, _ = run([first, *cut(rest, places)])
    assert_heard_as_llhttp_reads(heard, first + rest)


FIRST = HEAD + b"2\r\nhi\r\n"


@pytest.mark.parametrize(
    "reads",
    [
        # A read that ends in a size line's first digit: the next is not a chunk's start.
        [FIRST + b"1", b"5\r\nhello\r\n0\r\n\r\n"],
        # A read that ends right after a size line: the data that follows looks like a chunk.
        [FIRST + b"8\r\n", b"3\r\nabc\r\n\r\n0\r\n\r\n"],
        # An extension, and data whose CRLF sits where a misread size line would put it.
        [FIRST, b"5;e\r\nabc\r\n\r\n0\r\n\r\n"],
        # Not a hex digit.
        [FIRST, b"1g\r\n" + b"x" * 32 + b"\r\n0\r\n\r\n"],
        # Data longer than its size says, then a whole last chunk.
        [FIRST, b"1\r\n5gg0\r\n\r\n"],
        # A head whose coding llhttp does not read as chunked, read by read.
        [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\xa0\r\n\r\n",
            b"5\r\nhello\r\n",
            b"0\r\n\r\n",
        ],
        # An interim answer's chunks, then (in another read) the final answer's: llhttp
        # refuses a second answer after "Connection: close", and so must the short way.
        [
            b"HTTP/1.1 150 X\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n",
            b"0\r\n\r\n" + HEAD + b"5\r\nhello\r\n0\r\n\r\n",
        ],
        # A size the short way does not read (eight hex digits and more).
        [FIRST, b"000000005\r\nhello\r\n0\r\n\r\n"],
    ],
)
def test_framing_that_only_looks_plain_is_read_as_llhttp_reads_it(reads: list[bytes]) -> None:
    heard, _ = run(reads)
    assert_heard_as_llhttp_reads(heard, b"".join(reads))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=2, max_size=10))
def test_reads_of_whole_plain_chunks_after_the_first_are_not_parsed(pieces: list[bytes]) -> None:
    """One event per chunk per read, as a streaming server writes them: the parser sees
    the head and the first chunk (it must see a chunk end to know where it stands) and the
    last chunk, nothing else."""
    events = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces]
    reads = [HEAD + events[0], *events[1:], b"0\r\n\r\n"]
    heard, counting = run(reads)
    assert bytes(heard.body) == b"".join(pieces)
    assert heard.ended and not heard.broken
    assert counting.fed == len(reads[0]) + len(reads[-1])


def test_after_a_head_alone_the_parser_is_let_go_and_whole_chunks_are_not_parsed() -> None:
    """A stream's head, then its events one per read: llhttp reads the head and the last
    chunk only, and is not held between them (0.9 KiB of an idle stream)."""
    reads = [HEAD, b"5\r\nhello\r\n", b"6\r\n world\r\n", b"0\r\n\r\n"]
    held: list[bool] = []
    heard, counting = run(reads, after_each=lambda c: held.append(c._parser is not None))
    assert bytes(heard.body) == b"hello world"
    assert heard.ended
    assert counting.fed == len(reads[0]) + len(reads[-1])
    assert held == [False, False, False, True]  # the last chunk is llhttp's to read


def test_several_whole_chunks_in_one_read_then_a_cut_one_go_on_through_the_parser() -> None:
    first = b"5\r\nhello\r\n"
    reads = [HEAD + first, b"3\r\nabc\r\n4\r\ndefg\r\n6\r\nhi", b"jklm\r\n", b"1\r\nz\r\n0\r\n\r\n"]
    heard, counting = run(reads)
    assert bytes(heard.body) == b"helloabcdefghijklmz"
    assert heard.ended
    # The second read's whole chunks skip the parser, its cut one does not; the read
    # that ends that one leaves the parser between chunks again, so the next whole
    # chunk skips it too, and the last chunk does not.
    assert counting.fed == len(reads[0]) + len(b"6\r\nhi") + len(reads[2]) + len(b"0\r\n\r\n")


# -- a read written as it came ---------------------------------------------------


@pytest.mark.parametrize(
    ("read", "as_written"),
    [
        (b"5\r\nhello\r\n", True),
        (b"1a\r\n" + b"x" * 26 + b"\r\n", True),
        (b"1A\r\n" + b"x" * 26 + b"\r\n", False),  # upper case: legal, not the client's
        (b"A\r\n" + b"x" * 10 + b"\r\n", False),
        (b"05\r\nhello\r\n", False),  # a leading zero
        (b"%x\r\n" % 0xFEDCB + b"x" * 0xFEDCB + b"\r\n", True),
        (b"%X\r\n" % 0xFEDCB + b"x" * 0xFEDCB + b"\r\n", False),
        (b"%x\r\n" % 0x1000001 + b"x" * 0x1000001 + b"\r\n", True),  # eight digits, the most
    ],
)
def test_a_size_line_is_as_the_client_would_get_it_only_in_lower_case_hex_without_zeros(
    read: bytes, as_written: bool
) -> None:
    """The one-chunk read the sidecar may write to a chunked client as it came: ``%x``."""
    from streamwarden.net.upstream import _as_written, _chunk_head

    size, start = _chunk_head(read, 0)
    assert start + size + 2 == len(read)
    assert _as_written(read, start - 2) is as_written


class _Transport:
    """A client transport that keeps what it was given, object for object."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        raise AssertionError("not aborted here")


@pytest.mark.parametrize("chunked", [True, False])
def test_a_read_written_as_it_came_is_the_bytes_the_channel_would_frame(chunked: bool) -> None:
    from streamwarden.sidecar.channel import ClientChannel

    chunk = b"data: x\n\n"
    read = b"%x\r\n%b\r\n" % (len(chunk), chunk)
    framed, as_read = _Transport(), _Transport()
    ClientChannel(None, framed, chunked).write(chunk)  # type: ignore[arg-type]
    ClientChannel(None, as_read, chunked).write_as_read(chunk, read)  # type: ignore[arg-type]
    assert as_read.written == framed.written == [read if chunked else chunk]
    assert as_read.written[0] is (read if chunked else chunk)  # no copy made
