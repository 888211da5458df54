"""The SSE parsing corpus: the WHATWG examples and web-platform-tests cases, as bytes and events.

The table here holds the examples of the WHATWG HTML specification's
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

The decoder's conformance tests (tests/core/test_sse_conformance.py) and the
sidecar's (tests/faces/test_conformance_through_the_sidecar.py) run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamwarden.core.sse import Event

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
