"""Property tests for ``streamwarden.core.sse``: any bytes, any chunking.

The streams are built from an alphabet biased toward event-stream syntax
(field names, colons, spaces, every kind of line ending, byte order marks,
multi-byte and broken UTF-8, digits, NUL), so that short examples already
exercise the corners of the parsing rules. The decoder is compared with the
whole-stream reference in ``sse_reference.py``; the framers are checked
against the promises the relay builds on: frames are the input's own bytes,
cut only where a block (or line) ends, and memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sse_reference import block_boundary, reference_decode, reference_lines
from streamwarden.core.sse import Event, EventTooLarge, Frame, LineFramer, SSEDecoder, SSEFramer

BOM = b"\xef\xbb\xbf"

SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

PIECES: list[bytes] = [
    b"data",
    b"data",
    b"data:",
    b"event",
    b"id",
    b"retry",
    b":",
    b":",
    b" ",
    b" ",
    b"\r",
    b"\n",
    b"\n",
    b"\r\n",
    b"\n\n",
    BOM,
    b"x",
    b"ab",
    b"\t",
    b"\x00",
    b"0",
    b"7",
    b"42",
    "é".encode(),
    "€".encode(),
    "😀".encode(),
    "١".encode(),  # ARABIC-INDIC DIGIT ONE: a digit, but not an ASCII one
    b"\xe2\x82",  # a 3-byte sequence cut short
    b"\xf0\x9f",  # a 4-byte sequence cut short
    b"\xff",
    b"\xc0",
    b"\x80",
]

sse_streams = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=40).map(b"".join),
    # A BOM, or two, at the very start matters only there.
    st.tuples(
        st.sampled_from([BOM, BOM + BOM, BOM[:2], b""]),
        st.lists(st.sampled_from(PIECES), max_size=30).map(b"".join),
    ).map(b"".join),
    st.binary(max_size=40),
)


@st.composite
def chunked(
    draw: st.DrawFn, streams: st.SearchStrategy[bytes] = sse_streams
) -> tuple[bytes, list[bytes]]:
    """A stream and one way to cut it into chunks (empty chunks included)."""
    stream = draw(streams)
    if draw(st.integers(0, 4)) == 0:
        return stream, [stream[i : i + 1] for i in range(len(stream))]
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    bounds = [0, *cuts, len(stream)]
    return stream, [stream[a:b] for a, b in pairwise(bounds)]


def forwarded_body(stream: bytes) -> bytes:
    """The bytes an SSE framer forwards: the input without its leading BOM.

    A BOM followed by a second one is kept: stripped, it would leave the
    second one at the head of the forwarded bytes, where a client would
    strip it in turn and read the first field (which the upstream's reader
    ignores, as ``"\\ufeffdata"``) as a real one.
    """
    if stream.startswith(BOM) and not stream.startswith(BOM + BOM):
        return stream[len(BOM) :]
    return stream


def events_of(frames: Sequence[Frame]) -> list[Event]:
    return [frame.event for frame in frames if frame.event is not None]


_PROBE = b"data:probe\n\n"


def assert_frames_are_whole(frames: Sequence[Frame]) -> None:
    """Each frame is one block, cut right after the blank line that ends it.

    After every frame the reader is between blocks: an event appended there
    comes out on its own, with no data or event type left over to merge in.
    And there are as many frames as blank lines, apart from the LF of a CRLF
    whose CR ended the frame before (it came in a later read): that LF is a
    frame of its own, never the head of the next block.
    """
    forwarded = b""
    blocks = 0
    for k, frame in enumerate(frames, 1):
        if frame.raw.startswith(b"\n"):
            assert frame == Frame(b"\n", None)
        if not (frame.raw == b"\n" and forwarded.endswith(b"\r")):
            blocks += 1
        forwarded += frame.raw
        decoded, _ = reference_decode(forwarded + _PROBE)
        assert decoded[:-1] == events_of(frames[:k])
        assert (decoded[-1].event, decoded[-1].data) == ("message", "probe")
        text = forwarded.decode("utf-8", "replace").removeprefix("\ufeff")
        assert reference_lines(text).count("") == blocks


# --- (a) the decoder is the reference, at any chunking --------------------------


@SETTINGS
@given(chunked())
def test_decoder_matches_the_whole_stream_reference_at_any_chunking(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    decoder = SSEDecoder()
    events: list[Event] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    assert (events, decoder.retry) == reference_decode(stream)


# --- (b) the SSE framer forwards exactly what it consumed --------------------


@SETTINGS
@given(chunked())
@example((BOM + BOM + b"data:1\n\n", [BOM + BOM + b"data:1\n\n"]))  # wpt format-bom-2
@example((BOM, [BOM[:1], BOM[1:]]))
@example((b"data: x\r\n\r\n", [b"data: x\r\n\r", b"\n"]))  # a clean end, cut in its CRLF
@example((b": c\r\n\r\n", [b": c\r\n\r", b"\n"]))
@example((BOM + b"data: x\r\n\r\n", [BOM + b"data: x\r\n\r", b"\n"]))
def test_sse_framer_frames_are_the_input_prefix_and_redecode_to_the_same_events(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    framer = SSEFramer()
    frames: list[Frame] = []
    consumed = 0
    for chunk in chunks:
        frames += framer.feed(chunk)
        consumed += len(chunk)
        # After every chunk: what was forwarded, then what is held back, is
        # exactly what came in.
        body_so_far = forwarded_body(stream[:consumed])
        forwarded = b"".join(frame.raw for frame in frames)
        assert body_so_far.startswith(forwarded)
        assert framer.pending_bytes == len(body_so_far) - len(forwarded)
        # And what is held back is only the unfinished block (bytes that
        # may still turn out to be a BOM hold no line ending): a stream cut
        # here right after a blank line is a clean end, whatever the chunking.
        assert len(forwarded) == block_boundary(body_so_far)

    body = forwarded_body(stream)
    forwarded = b"".join(frame.raw for frame in frames)
    assert body.startswith(forwarded)
    assert framer.pending_bytes == len(body) - len(forwarded)
    expected_events, _ = reference_decode(stream)
    assert events_of(frames) == expected_events
    assert reference_decode(forwarded)[0] == expected_events
    assert_frames_are_whole(frames)
    assert framer.close() == []
    assert framer.pending_bytes == 0


# Blocks of many field lines, most of them data: more data lines than the
# framer tracks by offset (16), so that joining them by rescanning the block
# is exercised too, at every kind of line ending and chunking.
_FIELD_LINES = st.tuples(
    st.sampled_from(
        [b"data", b"data:", b"data: ", b"data: ", b"data:", b"event:", b"id:", b":", b""]
    ),
    st.sampled_from([b"", b"a", b" b", b"\xff", "é".encode(), b"\x00", b"\xe2\x82"]),
    st.sampled_from([b"\n", b"\r", b"\r\n"]),
).map(b"".join)
_BLANK_LINES = st.sampled_from([b"\n", b"\r", b"\r\n"])
_DATA_RUNS = st.lists(
    st.tuples(
        st.sampled_from([b"data", b"data:", b"data: "]),
        st.sampled_from([b"", b"a", b" b", b"\xff", "é".encode()]),
        st.sampled_from([b"\n", b"\r", b"\r\n"]),
    ).map(b"".join),
    min_size=14,
    max_size=40,
).map(b"".join)
# Blank lines one element in ten, so several blocks per stream (and blocks
# left open at chunk ends, whose offsets move when the buffer is compacted);
# runs of 14 to 40 data lines go past what is tracked.
data_heavy_streams = st.lists(
    st.one_of(*[_FIELD_LINES] * 8, _BLANK_LINES, _DATA_RUNS), min_size=20, max_size=80
).map(b"".join)


@SETTINGS
@given(
    st.lists(st.sampled_from([p for p in PIECES if b"\r" not in p and b"\n" not in p])).map(
        b"".join
    ),
    st.sampled_from([b"", b"event: delta\n", b"event:\xff\xfe\n"]),
)
def test_a_read_that_is_one_whole_event_decodes_as_the_reference_whatever_its_bytes(
    value: bytes, event_line: bytes
) -> None:
    """One event per read, with nothing held, is read the short way: its value (valid
    UTF-8 or not) decodes as in the spec's stream-wide decode."""
    stream = b"data: x\n\n" + event_line + b"data: " + value + b"\n\n"
    framer = SSEFramer()
    frames = framer.feed(b"data: x\n\n") + framer.feed(stream[len(b"data: x\n\n") :])
    assert events_of(frames) == reference_decode(stream)[0]


@SETTINGS
@given(chunked(data_heavy_streams))
@example((b"data:a\n" * 40 + b"\n", [b"data:a\n" * 20, b"data:a\n" * 20 + b"\n"]))
def test_events_of_many_data_lines_match_the_reference_at_any_chunking(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    decoder = SSEDecoder()
    events: list[Event] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    assert events == reference_decode(stream)[0]


# --- (c) bounded memory ----------------------------------------------------------


@SETTINGS
@given(chunked(), st.integers(1, 48))
def test_sse_framer_with_a_limit_raises_only_event_too_large_and_stays_bounded(
    case: tuple[bytes, list[bytes]], limit: int
) -> None:
    _, chunks = case
    # The same chunks through an unlimited framer: what the limited one must
    # match until it refuses, and the evidence that refusing was right.
    unlimited = SSEFramer()
    unlimited_frames: list[Frame] = []
    overflow = False
    for chunk in chunks:
        unlimited_frames += unlimited.feed(chunk)
        overflow = overflow or unlimited.pending_bytes > limit
    overflow = overflow or any(len(frame.raw) > limit for frame in unlimited_frames)

    framer = SSEFramer(max_event_bytes=limit)
    frames: list[Frame] = []
    raised: EventTooLarge | None = None
    for chunk in chunks:
        try:
            frames += framer.feed(chunk)
        except EventTooLarge as exc:
            raised = exc
            frames += exc.frames
            break
        # While it waits to see whether the stream starts with a BOM (or a
        # second one), the framer holds up to two bytes; no limit below six
        # bytes admits an event anyway (b"data\n\n" is the smallest block
        # that dispatches).
        assert framer.pending_bytes <= max(limit, 2)

    assert all(len(frame.raw) <= limit for frame in frames)
    assert frames == unlimited_frames[: len(frames)]
    assert_frames_are_whole(frames)
    if raised is None:
        assert frames == unlimited_frames
        if limit >= 2:
            assert not overflow
    else:
        assert overflow
        assert raised.limit == limit
        assert raised.size > limit
        assert framer.pending_bytes == 0
        try:
            framer.feed(b"data: more\n\n")
        except EventTooLarge:
            pass
        else:
            raise AssertionError("a framer that refused an event must stay unusable")


@SETTINGS
@given(chunked(), st.integers(1, 48))
def test_decoder_with_a_limit_raises_nothing_but_event_too_large(
    case: tuple[bytes, list[bytes]], limit: int
) -> None:
    stream, chunks = case
    decoder = SSEDecoder(max_event_bytes=limit)
    events: list[Event] = []
    try:
        for chunk in chunks:
            events += decoder.feed(chunk)
        events += decoder.close()
    except EventTooLarge:
        pass
    expected, _ = reference_decode(stream)
    assert events == expected[: len(events)]


# --- (d) the line framer -------------------------------------------------------

line_streams = st.one_of(
    st.lists(
        st.sampled_from(
            [
                b"{}",
                b'{"a":1}',
                b"0:",
                b'"hi"',
                b" ",
                b"\t",
                b"\r",
                b"\r\r",
                b"\n",
                b"\r\n",
                *PIECES,
            ]
        ),
        max_size=30,
    ).map(b"".join),
    st.binary(max_size=40),
)


def line_frames(chunks: Sequence[bytes]) -> list[Frame]:
    framer = LineFramer()
    frames: list[Frame] = []
    for chunk in chunks:
        frames += framer.feed(chunk)
    return frames + framer.close()


def expected_line_frame(raw: bytes) -> Frame:
    """A line's frame: its text is the line without its LF and the one CR before it."""
    text = raw.removesuffix(b"\n").removesuffix(b"\r")
    if text.strip() == b"":  # blank (or white-space only): no event
        return Frame(raw, None)
    return Frame(raw, Event("message", text.decode("utf-8", "replace"), None))


@SETTINGS
@given(chunked(line_streams))
@example((b'{"a":1}\r\r\n{}\r', [b'{"a":1}\r', b"\r\n{}\r"]))  # a CR that is not the line's ending
def test_line_framer_frames_are_the_input_lines_at_any_chunking(
    case: tuple[bytes, list[bytes]],
) -> None:
    stream, chunks = case
    frames = line_frames(chunks)
    whole = [raw for raw in _lf_lines(stream) if raw.endswith(b"\n")]
    # Every complete line comes out; an unterminated last line is dropped at close.
    assert b"".join(frame.raw for frame in frames) == b"".join(whole)
    assert all(frame.raw.endswith(b"\n") for frame in frames)
    assert all(frame.raw.count(b"\n") == 1 for frame in frames)
    assert frames == [expected_line_frame(raw) for raw in whole]
    assert frames == line_frames([stream])


def _lf_lines(stream: bytes) -> list[bytes]:
    """The stream's lines, each with its LF; only LF ends a line (not a lone CR)."""
    lines = [line + b"\n" for line in stream.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return [line for line in lines if line]


@SETTINGS
@given(chunked(line_streams), st.integers(1, 24))
def test_line_framer_with_a_limit_raises_only_event_too_large_with_whole_lines(
    case: tuple[bytes, list[bytes]], limit: int
) -> None:
    stream, chunks = case
    lines = _lf_lines(stream)
    framer = LineFramer(max_event_bytes=limit)
    frames: list[Frame] = []
    try:
        for chunk in chunks:
            frames += framer.feed(chunk)
            assert framer.pending_bytes <= limit
        frames += framer.close()
    except EventTooLarge as exc:
        frames += exc.frames
        assert any(len(line) > limit for line in lines)
    else:
        assert all(len(line) <= limit for line in lines)
    whole = [raw for raw in lines if raw.endswith(b"\n")]
    assert frames == [expected_line_frame(raw) for raw in whole[: len(frames)]]


# --- (e) work per read ---------------------------------------------------------


class SearchCounter(bytearray):
    """A framer buffer that counts the bytes its ``find`` calls look at.

    Counting is deterministic where timing a run on a busy CI machine is
    not; what it counts is the work that grows with the input.
    """

    searched = 0

    def find(self, sub: object, start: int | None = 0, end: int | None = None) -> int:  # type: ignore[override]
        start = start or 0
        stop = len(self) if end is None else end
        found = super().find(sub, start, stop)  # type: ignore[arg-type]
        self.searched += (found + 1 if found != -1 else stop) - start
        return found


def searched_while_feeding(framer: SSEFramer | LineFramer, stream: bytes) -> int:
    counter = SearchCounter()
    framer._buf = counter  # white-box: the one buffer every search runs over
    for i in range(len(stream)):
        framer.feed(stream[i : i + 1])
    return counter.searched


LONG = 64 * 1024


def test_a_line_that_arrives_a_byte_per_read_is_searched_once_not_once_per_read() -> None:
    # A hostile upstream can send one byte per packet; searching the held
    # line again on every read would cost the square of its length.
    sse = b"data: " + b"x" * LONG + b"\n\n"
    assert searched_while_feeding(SSEFramer(), sse) < 4 * len(sse)
    ndjson = b'{"a":"' + b"x" * LONG + b'"}\n'
    assert searched_while_feeding(LineFramer(), ndjson) < 4 * len(ndjson)
