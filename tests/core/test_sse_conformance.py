"""Conformance of ``streamwarden.core.sse`` to the WHATWG server-sent events parsing rules.

The table (``sse_corpus.py``) holds the examples of the WHATWG HTML
specification's "Server-sent events" section and the parsing tests of
web-platform-tests' ``eventsource/`` directory, each restated as the bytes a
server sends and the events and reconnection time a conforming parser
reports.

Every case runs fed whole, byte by byte, and split in two at every
position, and through :class:`SSEFramer`, whose frames must be the input's
own bytes and decode to the same events. Each case is also checked against
the independent reference in ``sse_reference.py``, so that the table, the
reference and the decoder all agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from sse_corpus import ALL_CASES, BOM, CASE_IDS, PUBLIC_CASES, SPEC, WPT, Case
from sse_reference import block_boundary, reference_decode
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import Event, Frame, SSEDecoder, SSEFramer

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
