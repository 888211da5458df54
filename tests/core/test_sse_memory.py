"""What a framer holds while a hostile upstream sends one endless event.

The relay keeps at most one incomplete block (or line) per stream, and
refuses it past ``max_event_bytes``. These tests measure with
``tracemalloc`` the peak memory a framer allocates while it is fed the
worst line shapes up to that limit, and compare it with the limit.

The bound while feeding is ``1.5 * max_event_bytes + 64 KiB``. The held
raw bytes alone reach the limit plus one read before the framer refuses
them, and CPython over-allocates a growing ``bytearray`` by up to an
eighth: about 1.2 times the limit, measured. The rest is margin for
allocators and Python versions. It still tells the designs apart: anything
kept per line costs at least an 8-byte pointer per 6-byte ``data:`` line,
1.33 times the limit on top of the raw bytes, and the decoded string per
line that the framer used to keep cost 2.4 to 14 times the limit.

At dispatch the framer may use, besides the raw bytes it holds, only what
it hands out (the frame's copy of the bytes, the event's data) and what
Python's UTF-8 decoder needs for that data.

The limit is 256 KiB (reads of 16 KiB) rather than the 8 MiB default:
tracing makes the per-line loop about ten times slower, and the ratios do
not depend on the size (the same shapes at 1 MiB and 8 MiB measure the
same ratios).
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from sse_reference import reference_decode
from streamwarden.core.sse import Event, EventTooLarge, Frame, LineFramer, SSEDecoder, SSEFramer

LIMIT = 256 * 1024
READ = 16 * 1024
CONSTANT = 64 * 1024
FEEDING_BOUND = int(1.5 * LIMIT) + CONSTANT
HELD = int(1.25 * LIMIT)  # the raw bytes at their peak, over-allocation included

# One line, repeated: each keeps the block open (no blank line).
LINES = {
    "empty data lines": b"data:\n",
    "invalid utf-8 data lines": b"data:\xff\n",
    "one-byte values": b"data:x\n",
    "field lines named d": b"d\n",  # a 1-byte line would be a field named "d" too
    "comment flood": b":\n",
    "event lines": b"event:x\n",
    "id lines": b"id:x\n",
    "cr-ended invalid data lines": b"data:\xff\r",
}


@contextmanager
def traced() -> Iterator[Callable[[], int]]:
    """Trace allocations; yield a function that returns the peak so far, then resets it."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]

    def peak() -> int:
        used = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        return used

    try:
        yield peak
    finally:
        tracemalloc.stop()


def reads_of(stream: bytes) -> list[bytes]:
    # Cut before tracing starts: the test's own input is not the framer's memory.
    return [stream[at : at + READ] for at in range(0, len(stream), READ)]


def decoding_scratch(value: bytes) -> int:
    """What Python's decoder allocates beyond its result, for ``value``."""
    with traced() as peak:
        text = value.decode("utf-8", "replace")
        used = peak()
    return max(used - sys.getsizeof(text), 0)


def ratio(used: int) -> str:
    return f"{used / LIMIT:.2f} x max_event_bytes"


@pytest.mark.parametrize("line", LINES.values(), ids=LINES.keys())
def test_an_event_of_many_lines_costs_its_raw_bytes_and_what_it_hands_out(line: bytes) -> None:
    count = (LIMIT - 2) // len(line)
    reads = reads_of(line * count)
    framer = SSEFramer(LIMIT)
    with traced() as peak:
        # Up to the limit: only the raw bytes are held.
        for read in reads:
            assert framer.feed(read) == []
        used = peak()
        assert used < FEEDING_BOUND, ratio(used)
        # The blank line: the event, then nothing held.
        (frame,) = framer.feed(b"\n" if line.endswith(b"\n") else b"\r")
        used = peak()
    handed_out = len(frame.raw)
    scratch = 0
    if frame.event is not None:
        handed_out += sys.getsizeof(frame.event.data)
        value = line.removeprefix(b"data:")[:-1]
        scratch = decoding_scratch(b"\n".join([value] * count))
    assert used < HELD + handed_out + scratch + CONSTANT, ratio(used)
    assert framer.pending_bytes == 0


@pytest.mark.parametrize(
    "line", [b"data:\xff\n", b"d\n"], ids=["invalid utf-8 data lines", "field lines named d"]
)
def test_an_endless_event_is_refused_at_about_max_event_bytes(line: bytes) -> None:
    read = line * (READ // len(line))
    framer = SSEFramer(LIMIT)
    with traced() as peak, pytest.raises(EventTooLarge):
        for _ in range(2 * LIMIT // len(read)):
            framer.feed(read)
            assert peak() < FEEDING_BOUND
    assert framer.pending_bytes == 0


def test_an_endless_data_line_is_refused_at_about_max_event_bytes() -> None:
    framer = SSEFramer(LIMIT)
    framer.feed(b"data: ")
    with traced() as peak, pytest.raises(EventTooLarge):
        for _ in range(2 * LIMIT // READ):
            framer.feed(b"x" * READ)
            assert peak() < FEEDING_BOUND


def test_an_endless_ndjson_line_is_refused_at_about_max_event_bytes() -> None:
    framer = LineFramer(LIMIT)
    framer.feed(b'{"message":{"content":"')
    with traced() as peak, pytest.raises(EventTooLarge):
        for _ in range(2 * LIMIT // READ):
            framer.feed(b"\xff" * READ)
            assert peak() < FEEDING_BOUND


@pytest.mark.parametrize(
    "value", [b"x", b"\xff", "é".encode()], ids=["ascii", "invalid utf-8", "two-byte utf-8"]
)
def test_one_data_line_near_the_limit_costs_its_bytes_and_what_it_hands_out(
    value: bytes,
) -> None:
    data = value * ((LIMIT - 8) // len(value))
    reads = reads_of(b"data: " + data + b"\n\n")
    framer = SSEFramer(LIMIT)
    with traced() as peak:
        frames = [frame for read in reads for frame in framer.feed(read)]
        used = peak()
    (frame,) = frames
    assert frame.event is not None
    handed_out = len(frame.raw) + sys.getsizeof(frame.event.data)
    assert used < HELD + handed_out + decoding_scratch(data) + CONSTANT, ratio(used)


def test_a_line_near_the_limit_costs_its_bytes_and_what_it_hands_out() -> None:
    data = b"\xff" * (LIMIT - 20)
    reads = reads_of(b'{"a":"' + data + b'"}\r\n')
    framer = LineFramer(LIMIT)
    with traced() as peak:
        frames = [frame for read in reads for frame in framer.feed(read)]
        used = peak()
    (frame,) = frames
    assert frame.event is not None
    handed_out = len(frame.raw) + sys.getsizeof(frame.event.data)
    scratch = decoding_scratch(b'{"a":"' + data + b'"}')
    assert used < HELD + handed_out + scratch + CONSTANT, ratio(used)


# -- large frames decode as small ones do ----------------------------------------------
# Frames and values of 64 KiB or more are copied and decoded through a
# memoryview rather than a slice; the small-input property tests never get there.

BIG = 100_000


def chunkings(stream: bytes) -> Iterator[list[bytes]]:
    yield [stream]
    for size in (1400, 4093, 65536):
        yield [stream[i : i + size] for i in range(0, len(stream), size)]


LARGE_STREAMS = {
    "long ascii data": b"data: " + b"x" * BIG + b"\n\n",
    "long data with broken utf-8": b"data: "
    + ("é€😀".encode() + b"\xff\xe2\x82") * (BIG // 12)
    + b"\r\n\r\n",
    "long event, id and data": b"event: " + b"e" * BIG + b"\nid: " + b"i" * BIG + b"\ndata: a\n\n",
    "many data lines": b"".join(b"data: %d\n" % i for i in range(BIG // 4)) + b"\r\ndata: next\n\n",
    "many data lines, CR-ended": b"".join(b"data:%d\r" % i for i in range(BIG // 4)) + b"\r",
    "long comment": b":" + b"c" * BIG + b"\n\ndata: after\n\n",
}


@pytest.mark.parametrize("stream", LARGE_STREAMS.values(), ids=LARGE_STREAMS.keys())
def test_large_blocks_decode_like_the_reference_at_any_chunking(stream: bytes) -> None:
    expected, _ = reference_decode(stream)
    for chunks in chunkings(stream):
        decoder = SSEDecoder()
        events: list[Event] = []
        for chunk in chunks:
            events += decoder.feed(chunk)
        assert events == expected
        framer = SSEFramer()
        frames: list[Frame] = []
        for chunk in chunks:
            frames += framer.feed(chunk)
        assert b"".join(frame.raw for frame in frames) == stream


LARGE_LINES = {
    "long json line": b'{"a":"' + b"x" * BIG + b'"}\n',
    "long crlf line with broken utf-8": b'{"a":"' + b"\xff\xc3" * BIG + b'"}\r\n',
    "long blank line": b" \t" * BIG + b"\r\n",
    "long line that starts blank": b" " * BIG + b"{}\n",
    "long line ending in two crs": b"x" * BIG + b"\r\r\n",
}


@pytest.mark.parametrize("line", LARGE_LINES.values(), ids=LARGE_LINES.keys())
def test_large_lines_frame_like_small_ones_at_any_chunking(line: bytes) -> None:
    text = line.removesuffix(b"\n").removesuffix(b"\r")
    expected = (
        Frame(line, None)
        if not text.strip()
        else Frame(line, Event("message", text.decode("utf-8", "replace"), None))
    )
    for chunks in chunkings(line + b"{}\n"):
        framer = LineFramer()
        frames: list[Frame] = []
        for chunk in chunks:
            frames += framer.feed(chunk)
        assert frames == [expected, Frame(b"{}\n", Event("message", "{}", None))]
