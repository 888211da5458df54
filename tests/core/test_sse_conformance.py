"""Conformance of ``streamwarden.core.sse`` to the WHATWG server-sent events parsing rules.

The table below holds the examples of the WHATWG HTML specification's
"Server-sent events" section and the parsing tests of web-platform-tests'
``eventsource/`` directory, each restated as the bytes a server sends and
the events (type, data, last event ID) and reconnection time a conforming
parser reports. The expectations were written from each test's assertions;
no test code was copied.

How the web-platform-tests bytes were derived: ``resources/message.py``
answers with ``message + newline + "\\n"``, where ``newline`` is ``"\\n\\n"``
unless the test asks for ``newline=none``; so the streams below end with
``b"\\n\\n\\n"`` or ``b"\\n"`` accordingly. A browser reports
``lastEventId == ""`` where no ``id`` field was ever accepted; our
``Event.id`` is ``None`` there (DESIGN.md, "Public names"). A browser also
keeps its last event ID across reconnections; our decoder parses one
stream, so each server response is a case of its own.

Every case runs fed whole, byte by byte, and split in two at every
position, and through :class:`SSEFramer`, whose frames must be the input's
own bytes and decode to the same events. Each case is also checked against
the independent reference in ``sse_reference.py``, so that the table, the
reference and the decoder all agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest

from sse_reference import block_boundary, reference_decode
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import Event, Frame, SSEDecoder, SSEFramer

SPEC = "https://html.spec.whatwg.org/multipage/server-sent-events.html"
WPT = "https://github.com/web-platform-tests/wpt/blob/master/eventsource/"
BOM = b"\xef\xbb\xbf"

# What resources/message.py appends after the message.
WPT_DEFAULT_END = b"\n\n\n"
WPT_NEWLINE_NONE_END = b"\n"


@dataclass(frozen=True)
class Case:
    """One input stream and what a conforming parser makes of it."""

    name: str
    source: str
    stream: bytes
    events: tuple[tuple[str, str, str | None], ...]
    retry: int | None = None

    def expected_events(self) -> list[Event]:
        return [Event(event, data, id_) for event, data, id_ in self.events]


def msg(data: str, id_: str | None = None) -> tuple[str, str, str | None]:
    """An event of the default type."""
    return ("message", data, id_)


_LONG_COMMENT = b"x" * 2048  # format-comments: (new Array(2*1024+1)).join("x")

PUBLIC_CASES: list[Case] = [
    # --- WHATWG HTML, 9.2.1 Introduction -----------------------------------
    Case(
        "spec-intro-three-messages",
        SPEC + "#server-sent-events-intro",
        b"data: This is the first message.\n\n"
        b"data: This is the second message, it\n"
        b"data: has two lines.\n\n"
        b"data: This is the third message.\n\n",
        (
            msg("This is the first message."),
            msg("This is the second message, it\nhas two lines."),
            msg("This is the third message."),
        ),
    ),
    Case(
        "spec-intro-event-types",
        SPEC + "#server-sent-events-intro",
        b"event: add\ndata: 73857293\n\nevent: remove\ndata: 2153\n\nevent: add\ndata: 113411\n\n",
        (("add", "73857293", None), ("remove", "2153", None), ("add", "113411", None)),
    ),
    # --- WHATWG HTML, 9.2.6 Interpreting an event stream, examples ---------
    Case(
        "spec-stock-ticker-once-followed-by-a-blank-line",
        SPEC + "#event-stream-interpretation",
        b"data: YHOO\ndata: +2\ndata: 10\n\n",
        (msg("YHOO\n+2\n10"),),
    ),
    Case(
        "spec-four-blocks",
        SPEC + "#event-stream-interpretation",
        b": test stream\n\n"
        b"data: first event\nid: 1\n\n"
        b"data:second event\nid\n\n"
        b"data:  third event\n\n",
        (msg("first event", "1"), msg("second event", ""), msg(" third event", "")),
    ),
    Case(
        # "the end of the stream is not enough to trigger the dispatch of the
        # last event"
        "spec-four-blocks-without-the-final-blank-line",
        SPEC + "#event-stream-interpretation",
        b": test stream\n\n"
        b"data: first event\nid: 1\n\n"
        b"data:second event\nid\n\n"
        b"data:  third event\n",
        (msg("first event", "1"), msg("second event", "")),
    ),
    Case(
        "spec-two-events-empty-and-newline-last-block-discarded",
        SPEC + "#event-stream-interpretation",
        b"data\n\ndata\ndata\n\ndata:",
        (msg(""), msg("\n")),
    ),
    Case(
        "spec-two-identical-events-space-after-colon-ignored",
        SPEC + "#event-stream-interpretation",
        b"data:test\n\ndata: test\n\n",
        (msg("test"), msg("test")),
    ),
    # --- web-platform-tests eventsource/ -----------------------------------
    Case(
        "wpt-format-bom",
        WPT + "format-bom",
        BOM + b"data:1\n\n" + BOM + b"data:2\n\ndata:3" + WPT_DEFAULT_END,
        (msg("1"), msg("3")),
    ),
    Case(
        "wpt-format-bom-2",
        WPT + "format-bom-2",
        BOM + BOM + b"data:1\n\ndata:2\n\ndata:3" + WPT_DEFAULT_END,
        (msg("2"), msg("3")),
    ),
    Case(
        "wpt-format-comments",
        WPT + "format-comments",
        b"data:1\r:\x00\n:\r\ndata:2\n:"
        + _LONG_COMMENT
        + b"\rdata:3\n:data:fail\r:"
        + _LONG_COMMENT
        + b"\ndata:4\n"
        + WPT_NEWLINE_NONE_END,
        (msg("1\n2\n3\n4"),),
    ),
    Case(
        "wpt-format-data-before-final-empty-line",
        WPT + "format-data-before-final-empty-line",
        b"retry:1000\ndata:test1\n\nid:test\ndata:test2" + WPT_NEWLINE_NONE_END,
        (msg("test1"),),
        retry=1000,
    ),
    Case(
        "wpt-format-field-data",
        WPT + "format-field-data",
        b"data:\n\ndata\ndata\n\ndata:test" + WPT_DEFAULT_END,
        (msg(""), msg("\n"), msg("test")),
    ),
    Case(
        "wpt-format-field-event",
        WPT + "format-field-event",
        b"event:test\ndata:x\n\ndata:x" + WPT_DEFAULT_END,
        (("test", "x", None), msg("x")),
    ),
    Case(
        "wpt-format-field-event-empty",
        WPT + "format-field-event-empty",
        b"event: \ndata:data" + WPT_DEFAULT_END,
        (msg("data"),),
    ),
    Case(
        # resources/last-event-id.py, first request (no Last-Event-ID)
        "wpt-format-field-id-first-response",
        WPT + "format-field-id",
        "id: …\nretry: 200\ndata: hello\n\n".encode(),
        (msg("hello", "…"),),
        retry=200,
    ),
    Case(
        # resources/last-event-id.py, the reconnection, which echoes the
        # Last-Event-ID header as data (format-field-id, format-field-id-2)
        "wpt-format-field-id-reconnection-response",
        WPT + "format-field-id-2",
        "data: …\n\n".encode(),
        (msg("…"),),
    ),
    Case(
        "wpt-format-field-id-3-persists",
        WPT + "format-field-id-3",
        b"id: 1\ndata: 1\n\ndata: 2\n\nid: 2\ndata:3\n\ndata:4\n\n",
        (msg("1", "1"), msg("2", "1"), msg("3", "2"), msg("4", "2")),
    ),
    Case(
        "wpt-format-field-id-3-resets",
        WPT + "format-field-id-3",
        b"id: 1\ndata: 1\n\nid:\ndata:2\n\ndata:3\n\n",
        (msg("1", "1"), msg("2", ""), msg("3", "")),
    ),
    Case(
        "wpt-format-field-id-3-resets-id-without-colon",
        WPT + "format-field-id-3",
        b"id: 1\ndata: 1\n\nid\ndata:2\n\ndata:3\n\n",
        (msg("1", "1"), msg("2", ""), msg("3", "")),
    ),
    Case(
        # an earlier revision of format-field-id-3 ("changes and persists")
        "wpt-format-field-id-3-changes-and-persists",
        WPT + "format-field-id-3",
        b"id: 1\ndata: 1\n\nid: 2\ndata:2\n\ndata:3\n\n",
        (msg("1", "1"), msg("2", "2"), msg("3", "2")),
    ),
    *(
        Case(
            f"wpt-format-field-id-null-{label}",
            WPT + "format-field-id-null",
            b"id: " + value + b"\nretry: 200\ndata: hello\n\n",
            (msg("hello"),),
            retry=200,
        )
        for label, value in [
            ("nul-nul", b"\x00\x00"),
            ("x-nul", b"x\x00"),
            ("nul-x", b"\x00x"),
            ("x-nul-x", b"x\x00x"),
            ("space-nul", b" \x00"),
        ]
    ),
    Case(
        "wpt-format-field-parsing",
        WPT + "format-field-parsing",
        b"data:\x00\ndata:  2\rData:1\ndata\x00:2\ndata:1\r\x00data:4\nda-ta:3\rdata_5\n"
        b"data:3\rdata:\r\n data:32\ndata:4\n" + WPT_NEWLINE_NONE_END,
        (msg("\x00\n 2\n1\n3\n\n4"),),
    ),
    Case(
        "wpt-format-field-retry",
        WPT + "format-field-retry",
        b"retry:02000\ndata:x" + WPT_DEFAULT_END,
        (msg("x"),),
        retry=2000,
    ),
    Case(
        "wpt-format-field-retry-bogus",
        WPT + "format-field-retry-bogus",
        b"retry:2000\nretry:1000x\ndata:x" + WPT_DEFAULT_END,
        (msg("x"),),
        retry=2000,
    ),
    Case(
        "wpt-format-field-retry-empty",
        WPT + "format-field-retry-empty",
        b"retry\ndata:test" + WPT_DEFAULT_END,
        (msg("test"),),
        retry=None,
    ),
    Case(
        "wpt-format-field-unknown",
        WPT + "format-field-unknown",
        b"data:test\n data\ndata\nfoobar:xxx\njustsometext\n:thisisacommentyay\ndata:test"
        + WPT_DEFAULT_END,
        (msg("test\n\ntest"),),
    ),
    Case(
        "wpt-format-leading-space",
        WPT + "format-leading-space",
        b"data:\ttest\rdata: \ndata:test" + WPT_DEFAULT_END,
        (msg("\ttest\n\ntest"),),
    ),
    Case(
        "wpt-format-newlines",
        WPT + "format-newlines",
        b"data:test\r\ndata\ndata:test\r\n\r" + WPT_NEWLINE_NONE_END,
        (msg("test\n\ntest"),),
    ),
    Case(
        "wpt-format-null-character",
        WPT + "format-null-character",
        b"data:\x00\n\n" + WPT_DEFAULT_END,
        (msg("\x00"),),
    ),
    Case(
        # served with charset=windows-1252, which must make no difference
        "wpt-format-utf-8",
        WPT + "format-utf-8",
        b"data:ok\xe2\x80\xa6" + WPT_DEFAULT_END,
        (msg("ok…"),),
    ),
    Case(
        # resources/message2.py repeats this block every two seconds
        "wpt-event-data-lines-and-data-parsing",
        WPT + "event-data",
        b"data:msg\ndata: msg\n\n:\nfalsefield:msg\n\nfalsefield:msg\nData:data\n\n"
        b"data\n\ndata:end\n\n",
        (msg("msg\nmsg"), msg(""), msg("end")),
    ),
    Case(
        # resources/message.py with no parameters
        "wpt-eventsource-onmessage-default-message",
        WPT + "eventsource-onmessage",
        b"data: data" + WPT_DEFAULT_END,
        (msg("data"),),
    ),
]

HERE = "streamwarden (from the 9.2.6 rules)"

EDGE_CASES: list[Case] = [
    Case(
        "id-persists-across-events",
        HERE,
        b"id: 7\ndata: a\n\ndata: b\n\n",
        (msg("a", "7"), msg("b", "7")),
    ),
    Case("explicit-empty-id-gives-empty-string", HERE, b"id:\ndata: a\n\n", (msg("a", ""),)),
    Case(
        "id-is-none-until-an-id-field-is-accepted",
        HERE,
        b"data: a\n\nid: 1\ndata: b\n\n",
        (msg("a"), msg("b", "1")),
    ),
    Case(
        "id-containing-nul-keeps-the-previous-id",
        HERE,
        b"id: 1\ndata: a\n\nid: 2\x00\ndata: b\n\n",
        (msg("a", "1"), msg("b", "1")),
    ),
    Case(
        "id-set-in-a-block-without-data-still-applies",
        HERE,
        b"id: 5\n\ndata: a\n\n",
        (msg("a", "5"),),
    ),
    Case("retry-from-a-block-that-dispatches-no-event", HERE, b"retry: 1500\n\n", (), retry=1500),
    Case(
        "retry-in-a-comment-only-stream-is-kept", HERE, b": hi\nretry:10\n: bye\n\n", (), retry=10
    ),
    Case(
        "retry-rejects-anything-but-ascii-digits",
        HERE,
        b"retry: 10\n\nretry: 1 0\n\nretry: -5\n\nretry: +5\n\nretry: 5.0\n\n"
        b"retry:  7\n\nretry: 8 \n\n" + "retry: ١٢\n\nretry: ５\n\n".encode(),
        (),
        retry=10,
    ),
    Case("retry-zero-is-valid", HERE, b"retry: 0\n\n", (), retry=0),
    Case(
        "retry-larger-than-any-machine-integer",
        HERE,
        b"retry: 99999999999999999999999\n\n",
        (),
        retry=99999999999999999999999,
    ),
    Case(
        "retry-in-an-unterminated-last-line-is-discarded",
        HERE,
        b"retry: 5\n\nretry: 9",
        (),
        retry=5,
    ),
    Case("empty-data-line-dispatches-empty-data", HERE, b"data:\n\n", (msg(""),)),
    Case("data-without-colon-dispatches-empty-data", HERE, b"data\n\n", (msg(""),)),
    Case(
        "block-without-data-resets-the-event-type", HERE, b"event: ping\n\ndata: x\n\n", (msg("x"),)
    ),
    Case("empty-event-type-means-message", HERE, b"event:\ndata: x\n\n", (msg("x"),)),
    Case("last-event-field-wins", HERE, b"event: a\nevent: b\ndata: x\n\n", (("b", "x", None),)),
    Case(
        "event-type-is-not-trimmed",
        HERE,
        b"event:  a \x00b\ndata: x\n\n",
        ((" a \x00b", "x", None),),
    ),
    Case("only-one-leading-space-is-removed", HERE, b"data:   x \n\n", (msg("  x "),)),
    Case("leading-tab-is-kept", HERE, b"data:\tx\n\n", (msg("\tx"),)),
    Case("only-the-first-colon-separates", HERE, b"data: a: b:c\n\n", (msg("a: b:c"),)),
    Case("space-before-colon-makes-another-field", HERE, b"data :x\n\n", ()),
    Case("field-names-are-case-sensitive", HERE, b"DATA: x\nData: y\nEvent: z\nID: 1\n\n", ()),
    Case("unterminated-final-block-is-not-dispatched", HERE, b"data: x\n", ()),
    Case("unterminated-final-line-is-not-dispatched", HERE, b"data: x", ()),
    Case("cr-only-line-endings", HERE, b"data:a\rdata:b\r\r", (msg("a\nb"),)),
    Case("cr-cr-lf-is-a-line-and-a-blank-line", HERE, b"data:a\r\r\n", (msg("a"),)),
    Case("lf-cr-ends-a-block", HERE, b"data:a\n\r", (msg("a"),)),
    Case("mixed-line-endings", HERE, b"data:a\r\ndata:b\rdata:c\n\r\n", (msg("a\nb\nc"),)),
    Case("stray-blank-lines-dispatch-nothing", HERE, b"\n\r\n\r\n\rdata:x\n\n\n\r\n", (msg("x"),)),
    Case(
        "keep-alive-comments-between-events",
        HERE,
        b": keep-alive\n\ndata: x\n\n: keep-alive\n\n",
        (msg("x"),),
    ),
    Case(
        "comment-inside-an-event-does-not-split-it",
        HERE,
        b"data: a\n: ping\ndata: b\n\n",
        (msg("a\nb"),),
    ),
    Case("multibyte-utf8", HERE, "event: ü\ndata: €😀\nid: ✓\n\n".encode(), (("ü", "€😀", "✓"),)),
    Case(
        "invalid-utf8-becomes-replacement-characters",
        HERE,
        b"data:a\xffb\xe2\x82\nid:\xc0\xaf\n\n",
        (msg("a\ufffdb\ufffd", "\ufffd\ufffd"),),
    ),
    Case(
        "truncated-4-byte-sequence-is-one-replacement",
        HERE,
        b"data:\xf0\x9f\x98\n\n",
        (msg("\ufffd"),),
    ),
    Case(
        "surrogate-encoding-is-three-replacements",
        HERE,
        b"data:\xed\xa0\x80\n\n",
        (msg("\ufffd\ufffd\ufffd"),),
    ),
    Case(
        "invalid-bytes-in-field-name-make-an-unknown-field", HERE, b"dat\xe1:x\n\xffdata:y\n\n", ()
    ),
    Case("bom-inside-a-value-is-kept", HERE, "data: a\ufeffb\n\n".encode(), (msg("a\ufeffb"),)),
    Case("bom-only-stream", HERE, BOM, ()),
    Case("bom-then-blank-line", HERE, BOM + b"\ndata: x\n\n", (msg("x"),)),
    Case("partial-bom-is-not-a-bom", HERE, b"\xef\xbbdata: x\n\ndata: y\n\n", (msg("y"),)),
    Case("empty-stream", HERE, b"", ()),
    # CRLF framing to the very end: cut between the last CR and LF, the LF
    # must not be left over as the start of a block that never comes.
    Case("crlf-event-ends-the-stream", HERE, b"data: x\r\n\r\n", (msg("x"),)),
    Case("crlf-comments-only", HERE, b": ping\r\n\r\n: ping\r\n\r\n", ()),
    Case("bom-then-crlf-event", HERE, BOM + b"data: x\r\n\r\n", (msg("x"),)),
    Case(
        "gemini-style-crlf-framing",
        HERE,
        b'data: {"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}\r\n\r\n'
        b'data: {"candidates": [{"finishReason": "STOP"}]}\r\n\r\n',
        (
            msg('{"candidates": [{"content": {"parts": [{"text": "Hi"}]}}]}'),
            msg('{"candidates": [{"finishReason": "STOP"}]}'),
        ),
    ),
]

ALL_CASES = PUBLIC_CASES + EDGE_CASES
CASE_IDS = [case.name for case in ALL_CASES]


# --- helpers -----------------------------------------------------------------


def decode_chunks(chunks: Iterable[bytes]) -> tuple[list[Event], int | None]:
    decoder = SSEDecoder()
    events: list[Event] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return events, decoder.retry


def byte_by_byte(stream: bytes) -> list[bytes]:
    return [stream[i : i + 1] for i in range(len(stream))]


def two_chunk_splits(stream: bytes) -> Iterator[tuple[int, list[bytes]]]:
    for at in range(len(stream) + 1):
        yield at, [stream[:at], stream[at:]]


def without_bom(stream: bytes) -> bytes:
    """What an SSE framer forwards: the stream without its leading BOM.

    Unless a second BOM follows: then both stay (see
    ``test_double_bom_is_forwarded_so_that_a_client_reads_the_same_events``).
    """
    if stream.startswith(BOM) and not stream.startswith(BOM + BOM):
        return stream[3:]
    return stream


def assert_no_frame_starts_inside_a_line_ending(frames: list[Frame]) -> None:
    """A block's frame starts with the block's own first byte.

    The only frame that starts with an LF is that LF alone: a blank line of
    its own, or the second half of a CRLF whose CR ended the previous frame
    (it arrived in a later read). Glued to the next block instead, that LF
    would be held back with it and make a clean end look like an unfinished
    block.
    """
    for frame in frames:
        if frame.raw.startswith(b"\n"):
            assert frame == Frame(b"\n", None)


def check_framer(stream: bytes, chunks: list[bytes], expected: list[Event]) -> None:
    """Frames are the consumed input, byte for byte, and decode to the same events.

    After every chunk the framer holds back exactly the unfinished block,
    nothing more: everything up to the last blank line has been forwarded.
    """
    framer = SSEFramer()
    frames: list[Frame] = []
    consumed = 0
    for chunk in chunks:
        frames += framer.feed(chunk)
        consumed += len(chunk)
        so_far = without_bom(stream[:consumed])
        assert framer.pending_bytes == len(so_far) - block_boundary(so_far)
    body = without_bom(stream)
    forwarded = b"".join(frame.raw for frame in frames)
    assert forwarded == body[: len(forwarded)]
    assert framer.pending_bytes == len(body) - len(forwarded)
    assert len(forwarded) == block_boundary(body)
    assert_no_frame_starts_inside_a_line_ending(frames)
    assert [f.event for f in frames if f.event is not None] == expected
    redecoded, _ = decode_chunks([forwarded])
    assert redecoded == expected
    assert framer.close() == []
    assert framer.pending_bytes == 0


# --- the table, four ways ----------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_reference_implementation_agrees_with_the_published_expectation(case: Case) -> None:
    assert reference_decode(case.stream) == (case.expected_events(), case.retry)


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_decoder_gives_the_expected_events_when_fed_whole(case: Case) -> None:
    assert decode_chunks([case.stream]) == (case.expected_events(), case.retry)


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_decoder_gives_the_expected_events_when_fed_byte_by_byte(case: Case) -> None:
    assert decode_chunks(byte_by_byte(case.stream)) == (case.expected_events(), case.retry)


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_decoder_gives_the_expected_events_when_split_in_two_anywhere(case: Case) -> None:
    expected = (case.expected_events(), case.retry)
    for at, chunks in two_chunk_splits(case.stream):
        assert decode_chunks(chunks) == expected, f"split at byte {at}"


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_framer_frames_are_the_consumed_input_and_redecode_to_the_same_events(case: Case) -> None:
    expected = case.expected_events()
    check_framer(case.stream, [case.stream], expected)
    check_framer(case.stream, byte_by_byte(case.stream), expected)
    for _, chunks in two_chunk_splits(case.stream):
        check_framer(case.stream, chunks, expected)


def test_table_covers_every_public_source() -> None:
    # The WPT format-* parsing tests and the spec's examples named in the
    # brief; MIME type and networking tests are out of scope.
    wanted = {
        "format-bom",
        "format-bom-2",
        "format-comments",
        "format-data-before-final-empty-line",
        "format-field-data",
        "format-field-event",
        "format-field-event-empty",
        "format-field-id",
        "format-field-id-2",
        "format-field-id-3",
        "format-field-id-null",
        "format-field-parsing",
        "format-field-retry",
        "format-field-retry-bogus",
        "format-field-retry-empty",
        "format-field-unknown",
        "format-leading-space",
        "format-newlines",
        "format-null-character",
        "format-utf-8",
        "event-data",
    }
    covered = {case.source.removeprefix(WPT) for case in PUBLIC_CASES}
    assert wanted <= covered
    assert sum(case.source.startswith(SPEC) for case in PUBLIC_CASES) >= 6


# --- chunk boundaries ---------------------------------------------------------


def test_cr_at_chunk_end_and_lf_at_next_chunk_start_are_one_line_ending() -> None:
    # Read as two line endings, the split CRLF would make a blank line and
    # dispatch "a" on its own.
    decoder = SSEDecoder()
    assert decoder.feed(b"data:a\r") == []
    assert decoder.feed(b"\n") == []
    assert decoder.feed(b"data:b\r") == []
    assert decoder.feed(b"\ndata:c\r\n") == []
    assert decoder.feed(b"\r") == [Event(data="a\nb\nc")]
    assert decoder.feed(b"\n") == []  # the LF of the blank line's CRLF: no second blank line
    assert decoder.feed(b"data:d\n\n") == [Event(data="d")]


def test_cr_at_chunk_end_followed_by_other_bytes_is_a_line_ending_on_its_own() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data:a\r") == []
    assert decoder.feed(b"data:b\r") == []
    assert decoder.feed(b"\r") == [Event(data="a\nb")]


def test_cr_ending_a_blank_line_dispatches_without_waiting_for_the_next_byte() -> None:
    # The relay must not hold an event back until the upstream sends more.
    decoder = SSEDecoder()
    assert decoder.feed(b"data:a\r\r") == [Event(data="a")]


def test_framer_forwards_the_lf_of_a_split_crlf_as_a_frame_of_its_own() -> None:
    # The CR already ended the block (dispatching it at once); its LF,
    # arriving in the next read, is forwarded as soon as it comes, so the
    # framer holds nothing at a clean end and the next block's frame starts
    # with its own first line.
    framer = SSEFramer()
    [first] = framer.feed(b"data:a\r\n\r")
    assert first.raw == b"data:a\r\n\r"
    assert first.event == Event(data="a")
    assert framer.pending_bytes == 0
    assert framer.feed(b"\n") == [Frame(b"\n", None)]
    assert framer.pending_bytes == 0
    [second] = framer.feed(b"data:b\r\n\r\n")
    assert second.raw == b"data:b\r\n\r\n"
    assert second.event == Event(data="b")


def test_the_lf_of_a_split_crlf_leaves_with_the_next_block_in_one_read() -> None:
    framer = SSEFramer()
    framer.feed(b"data:a\r\n\r")
    lf, block = framer.feed(b"\ndata:b\r\n\r\n")
    assert (lf, block.raw) == (Frame(b"\n", None), b"data:b\r\n\r\n")


def test_the_lf_of_a_split_crlf_inside_a_block_stays_in_that_block() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data:a\r") == []
    [frame] = framer.feed(b"\ndata:b\n\n")
    assert frame.raw == b"data:a\r\ndata:b\n\n"
    assert frame.event == Event(data="a\nb")


def test_a_split_crlf_at_the_stream_start_after_a_bom() -> None:
    framer = SSEFramer()
    assert framer.feed(BOM + b"\r") == [Frame(b"\r", None)]
    assert framer.feed(b"\n") == [Frame(b"\n", None)]
    assert framer.pending_bytes == 0


def test_multibyte_utf8_characters_split_across_chunks_decode_intact() -> None:
    stream = "event: ü\ndata: €😀\nid: ✓\n\n".encode()
    expected = ([Event("ü", "€😀", "✓")], None)
    assert decode_chunks(byte_by_byte(stream)) == expected
    for at, chunks in two_chunk_splits(stream):
        assert decode_chunks(chunks) == expected, f"split at byte {at}"


def test_invalid_utf8_becomes_u_fffd_whatever_the_chunking() -> None:
    stream = b"data:\xff\xe2\x82 \xf0\x9f\x98\n\n"
    expected = ([Event(data="\ufffd\ufffd \ufffd")], None)
    assert decode_chunks([stream]) == expected
    assert decode_chunks(byte_by_byte(stream)) == expected


def test_bom_split_across_chunks_is_still_stripped() -> None:
    assert decode_chunks([b"\xef", b"\xbb", b"\xbfdata: x\n\n"]) == ([Event(data="x")], None)
    assert decode_chunks([b"\xef\xbb", b"\xbf", b"data: x\n\n"]) == ([Event(data="x")], None)


def test_double_bom_is_forwarded_so_that_a_client_reads_the_same_events() -> None:
    # format-bom-2: the second BOM makes the first line "\ufeffdata:1", an
    # unknown field. Forwarded with only the first BOM stripped, the bytes
    # would start with the second one, which a client strips in its turn,
    # dispatching "1" after all. Kept, they read the same with or without a
    # keep-alive comment written before them.
    stream = BOM + BOM + b"data:1\n\ndata:2\n\n"
    expected = [Event(data="2")]
    framer = SSEFramer()
    frames = framer.feed(stream)
    forwarded = b"".join(frame.raw for frame in frames)
    assert [f.event for f in frames if f.event is not None] == expected
    assert decode_chunks([forwarded])[0] == expected
    assert decode_chunks([b": keep-alive\n\n" + forwarded])[0] == expected
    assert reference_decode(forwarded)[0] == expected


def test_single_bom_is_not_forwarded_so_a_keep_alive_can_precede_the_first_event() -> None:
    framer = SSEFramer()
    forwarded = b"".join(frame.raw for frame in framer.feed(BOM + b"data:1\n\n"))
    assert forwarded == b"data:1\n\n"
    assert decode_chunks([b": keep-alive\n\n" + forwarded])[0] == [Event(data="1")]


def test_empty_chunks_change_nothing() -> None:
    assert decode_chunks([b"", b"data: x", b"", b"\n", b"", b"\n", b""]) == (
        [Event(data="x")],
        None,
    )


# --- end of stream, id, retry --------------------------------------------------


def test_close_does_not_dispatch_an_unterminated_final_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: complete\n\ndata: partial\n") == [Event(data="complete")]
    assert decoder.close() == []


def test_close_does_not_dispatch_an_event_whose_last_line_ended_in_a_lone_cr() -> None:
    # The CR ends the data line, but no blank line follows it.
    decoder = SSEDecoder()
    assert decoder.feed(b"data: partial\r") == []
    assert decoder.close() == []


def test_framer_close_drops_the_pending_partial_block() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: partial\n") == []
    assert framer.pending_bytes == len(b"data: partial\n")
    assert framer.close() == []
    assert framer.pending_bytes == 0


def test_retry_is_set_by_a_block_that_dispatches_no_event() -> None:
    decoder = SSEDecoder()
    assert decoder.retry is None
    assert decoder.feed(b"retry: 2500\n\n") == []
    assert decoder.retry == 2500
    assert decoder.feed(b"retry: soon\n\n") == []
    assert decoder.retry == 2500


def test_retry_applies_as_soon_as_its_line_ends_not_at_dispatch() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: x\nretry: 300\n")
    assert decoder.retry == 300


def test_a_retry_too_long_for_an_int_is_ignored_instead_of_breaking_the_decoder() -> None:
    # Python refuses to convert more than 4,300 digits (a guard against
    # quadratic work), so a hostile upstream could make the decoder raise
    # ValueError. Such a value is ignored, as browsers ignore one that
    # overflows their integer; leading zeros do not count toward the limit.
    decoder = SSEDecoder()
    decoder.feed(b"retry: 1000\n\n")
    assert decoder.feed(b"retry: " + b"9" * 5000 + b"\ndata: x\n\n") == [Event(data="x")]
    assert decoder.retry == 1000
    decoder.feed(b"retry: " + b"0" * 5000 + b"25\n\n")
    assert decoder.retry == 25
    assert decoder.feed(b"retry: " + b"0" * 5000 + b"\n\n") == []
    assert decoder.retry == 0


def test_id_persists_across_events_and_explicit_empty_id_gives_empty_string() -> None:
    decoder = SSEDecoder()
    events = decoder.feed(b"data: a\n\nid: 1\ndata: b\n\ndata: c\n\nid\ndata: d\n\ndata: e\n\n")
    assert [(e.data, e.id) for e in events] == [
        ("a", None),
        ("b", "1"),
        ("c", "1"),
        ("d", ""),
        ("e", ""),
    ]


def test_empty_data_line_dispatches_an_event_with_empty_data() -> None:
    assert decode_chunks([b"data:\n\n"]) == ([Event(data="")], None)
    assert decode_chunks([b"data: \n\n"]) == ([Event(data="")], None)


# --- through the relay ------------------------------------------------------

RELAY_LIMITS = Limits(
    keepalive_interval=15.0,
    upstream_idle_timeout=60.0,
    max_stream_duration=1800.0,
    max_event_bytes=1 << 20,
)


def relay_generic(chunks: list[bytes]) -> tuple[bytes, Relay]:
    relay = Relay(
        RELAY_LIMITS,
        started_at=0.0,
        now=0.0,
        path="/events",
        content_type="text/event-stream",
        headers={},
        dialect="generic",
    )
    out = b"".join(relay.feed(chunk, 1.0) for chunk in chunks)
    return out + relay.upstream_eof(2.0), relay


@pytest.mark.parametrize("case", ALL_CASES, ids=CASE_IDS)
def test_relay_ends_a_generic_stream_cleanly_exactly_when_it_ended_between_blocks(
    case: Case,
) -> None:
    # A generic stream has no terminal event: ending after a blank line is
    # a clean end, whatever the reads were; ending inside a block is not.
    body = without_bom(case.stream)
    clean = block_boundary(body) == len(body)
    chunkings = [[case.stream], byte_by_byte(case.stream)]
    chunkings += [chunks for _, chunks in two_chunk_splits(case.stream)]
    for chunks in chunkings:
        out, relay = relay_generic(chunks)
        if clean:
            assert out == body, chunks
            assert relay.end_state == "completed", chunks
        else:
            assert out.startswith(body[: block_boundary(body)])
            error = out[block_boundary(body) :]
            assert SSEDecoder().feed(error)[0].event == "error", chunks
            assert relay.meter.error_code == "stream_truncated", chunks
