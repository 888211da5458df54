"""The output filters' matcher against what a reviewer tried: cuts, cards, floods, long matches.

Each case is decided on the whole text first; the same text cut into events
at every place (or at the hostile one) must be decided the same way.
"""

from __future__ import annotations

import json
import sys
from types import FrameType
from typing import Any

import pytest

from filter_streams import BLOCK, REDACT, SECRET
from filter_streams import relay as dialect_relay
from filter_streams import run as run_reads
from streamwarden.core.filters import REDACTED, FilterError, FilterRule, Holdback, compile_filters
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Limits, Relay
from streamwarden.pipeline.transforms import with_transforms

LIMITS = Limits(15.0, 60.0, 1800.0, 1 << 20)
CARDS = (FilterRule("builtin", "cards", "redact", "cards"),)


def _event(piece: str) -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
    return ("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n").encode()


def _relay(rules: tuple[FilterRule, ...]) -> Relay:
    return with_transforms(
        Relay(
            LIMITS,
            started_at=0.0,
            now=0.0,
            path="/v1/chat/completions",
            content_type="text/event-stream",
            headers={},
        ),
        filters=compile_filters(rules, False),
    )


def _answer(rules: tuple[FilterRule, ...], pieces: list[str]) -> tuple[str, Relay]:
    """What a client reads of ``pieces`` (one event each) through the filters."""
    r = _relay(rules)
    out = b"".join(r.feed(_event(p), float(i)) for i, p in enumerate(pieces))
    out += r.feed(b"data: [DONE]\n\n", 99.0) + r.upstream_eof(100.0)
    text = ""
    for block in out.split(b"\n\n"):
        if block.startswith(b"data: {") and b'"choices"' in block:
            text += json.loads(block[6:])["choices"][0]["delta"]["content"]
    return text, r


def _every_cut(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(1, len(text))]


def test_a_match_that_could_still_grow_is_redacted_whole_wherever_the_text_is_cut() -> None:
    rules = (FilterRule("regex", r"ACCT-\d{4}(?:-\d{4})?", "redact", "account"),)
    text = "id ACCT-1234-5678 ok"
    whole, _ = _answer(rules, [text])
    assert whole == f"id {REDACTED} ok"
    for pieces in [*_every_cut(text), list(text)]:
        assert _answer(rules, pieces)[0] == whole, pieces


@pytest.mark.parametrize(
    "text",
    [
        "Card: 4111 1111 1111 1111 12/25 thanks",
        "4111111111111111 5 items",
        "pay 4111-1111-1111-1111-77 now",
    ],
)
def test_a_card_number_followed_by_more_digits_is_still_redacted(text: str) -> None:
    whole, _ = _answer(CARDS, [text])
    assert "4111" not in whole and REDACTED in whole
    for pieces in [*_every_cut(text), list(text)]:
        assert _answer(CARDS, pieces)[0] == whole, pieces


def test_a_digit_run_that_is_no_card_number_passes_whatever_the_cuts() -> None:
    text = "order 1234 5678 9012 3456 shipped"  # 16 digits, not Luhn-valid
    for pieces in [[text], *_every_cut(text)]:
        assert _answer(CARDS, pieces)[0] == text


def test_a_block_match_that_runs_past_its_max_length_fails_closed() -> None:
    # The configured bound says no match is longer than 24 characters; one is.
    rules = (FilterRule("regex", r"BEGIN[^E]{1,200}END", "block", "envelope", 24),)
    text = "x BEGIN" + "a" * 40 + "END y"
    _, whole = _answer(rules, [text])
    assert whole.end_state is EndState.BLOCKED
    _, pieced = _answer(rules, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert pieced.end_state is EndState.BLOCKED


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"^secret", "anchors"),
        (r"secret$", "anchors"),
        (r"\Asecret", "anchors"),
        (r"(?<![a-z]{40})secret", "look-behind longer than"),
    ],
)
def test_a_pattern_that_a_window_of_the_text_cannot_decide_is_refused(
    pattern: str, why: str
) -> None:
    with pytest.raises(FilterError, match=why):
        compile_filters((FilterRule("regex", pattern, "redact", "p"),), False)


def _lines_run_in_push(holdback: Holdback[Any], frames: int) -> list[int]:
    """Lines executed by each ``push`` of a comment frame while a prefix waits."""
    counts: list[int] = []
    push_code = Holdback.push.__code__

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is push_code and event == "line":
            counts[-1] += 1
        return tracer

    for _ in range(frames):
        counts.append(0)
        sys.settrace(tracer)
        try:
            holdback.push(None, "", 3, 0.0)
        finally:
            sys.settrace(None)
    return counts


def test_a_flood_of_events_behind_a_pending_prefix_costs_the_same_per_event() -> None:
    holdback = compile_filters((FilterRule("builtin", "secrets", "block", "secrets"),), False)
    assert holdback is not None
    waiting = holdback.holdback(1 << 20)
    assert waiting.push(None, "key: sk-", 8, 0.0) == []  # a prefix: it waits
    counts = _lines_run_in_push(waiting, 300)
    assert waiting.holding
    # A push does the same work with 10 events waiting as with 300: not O(n) each.
    assert counts[10] == counts[-1]


SECRETS_AND_CARDS = (
    FilterRule("builtin", "secrets", "redact", "secrets"),
    FilterRule("builtin", "cards", "redact", "cards"),
)


def test_a_key_whose_start_is_still_open_is_not_skipped_for_a_later_match_inside_it() -> None:
    # AKIA and 13 digits: a card-shaped run inside a key that is still arriving.
    text = "id AKIA1234567890123456 and then " + "more words " * 30
    whole, _ = _answer(SECRETS_AND_CARDS, [text])
    assert "AKIA" not in whole and REDACTED in whole
    cut = text.index("AKIA") + 4 + 13
    assert _answer(SECRETS_AND_CARDS, [text[:cut], text[cut:]])[0] == whole


def test_a_literal_inside_a_key_does_not_let_the_rest_of_the_key_through() -> None:
    rules = (
        FilterRule("literal", "Q7eX", "redact", "fragment"),
        FilterRule("builtin", "secrets", "redact", "secrets"),
    )
    key = "sk-proj-Q7eXg9TzK2mLw4RbN8vYc1HdJ"
    text = f"key {key} end"
    cut = text.index("Q7eX") + 4
    for pieces in ([text], [text[:cut], text[cut:]], list(text)):
        answer = _answer(rules, pieces)[0]
        assert answer == f"key {REDACTED} end", pieces


@pytest.mark.parametrize("cut_into_characters", [False, True])
def test_at_one_start_a_block_wins_and_else_the_longest_match(cut_into_characters: bool) -> None:
    key = "sk-proj-Q7eXg9TzK2mLw4RbN8vYc1HdJ"

    def pieces(text: str) -> list[str]:
        return list(text) if cut_into_characters else [text]

    # A short redact and the key's block at the same start: the block wins.
    rules = (
        FilterRule("literal", "sk-proj", "redact", "prefix"),
        FilterRule("builtin", "secrets", "block", "secrets"),
    )
    _, blocked = _answer(rules, pieces(f"key {key} end"))
    assert blocked.end_state is EndState.BLOCKED
    # Two redacts at one start: the longer one is what is redacted.
    rules = (
        FilterRule("literal", "hunter", "redact", "short"),
        FilterRule("literal", "hunter2-prod-password", "redact", "long"),
    )
    assert _answer(rules, pieces("pw hunter2-prod-password ok"))[0] == f"pw {REDACTED} ok"


def test_a_redact_match_longer_than_its_max_length_blocks_whole_or_cut() -> None:
    rules = (FilterRule("regex", r"BEGIN[^E]{1,200}END", "redact", "envelope", 24),)
    text = "x BEGIN" + "a" * 40 + "END y"
    for pieces in ([text], list(text)):
        assert _answer(rules, pieces)[1].end_state is EndState.BLOCKED


@pytest.mark.parametrize("pattern", [r"^\p{Lu}{3}-\d{4}", r"(?<=\p{L}{40})\d{4}", r"\p{L}{3}$"])
def test_a_pattern_in_syntax_only_regex_knows_is_checked_too(pattern: str) -> None:
    with pytest.raises(FilterError):
        compile_filters((FilterRule("regex", pattern, "redact", "p", 64),), False)


def test_a_look_ahead_is_given_the_text_it_reads_before_a_match_is_decided() -> None:
    rules = (FilterRule("regex", r"abc(?=defgh)", "redact", "p"),)
    text = "x abcdefgh y"
    whole, _ = _answer(rules, [text])
    assert whole == f"x {REDACTED}defgh y"
    assert _answer(rules, list(text))[0] == whole
    blocking = (FilterRule("regex", r"abc(?!defgh)", "block", "p"),)
    assert _answer(blocking, list(text))[1].end_state is EndState.COMPLETED


# -- text the dialect does not read fails closed ------------------------------------------


def _sse(kind: str | None, data: str) -> str:
    return (f"event: {kind}\n" if kind else "") + f"data: {data}\n\n"


_UNREAD = {
    # The event's name says one thing, its data (what the SDKs go by) another.
    "responses-type-mismatch": (
        "openai-responses",
        _sse(
            "response.in_progress",
            json.dumps({"type": "response.output_text.delta", "delta": f"key {SECRET}"}),
        ),
    ),
    # A first event of another dialect, on a chat path: the chunks after it
    # would be read by the wrong dialect.
    "sniffing-decoy": (
        "generic",
        _sse(None, '{"choices":[]}') + _sse(None, f"key {SECRET} end"),
    ),
    # A text the Messages API can carry where no delta is.
    "anthropic-block-start": (
        "anthropic",
        _sse(
            "content_block_start",
            json.dumps(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": f"key {SECRET}"},
                }
            ),
        ),
    ),
    # JSON nested deeper than the parsers take: what a browser's JSON.parse still shows.
    "too-deep": (
        "openai-chat",
        "data: "
        + '{"choices":[{"index":0,"delta":{"content":"key '
        + SECRET
        + '"}}],"x":'
        + "[" * 1100
        + "]" * 1100
        + "}\n\n",
    ),
}


@pytest.mark.parametrize("case", sorted(_UNREAD))
@pytest.mark.parametrize("rules", [REDACT, BLOCK], ids=["redact", "block"])
def test_a_key_in_text_the_dialect_does_not_read_blocks_the_stream(
    case: str, rules: tuple[FilterRule, ...]
) -> None:
    dialect, stream = _UNREAD[case]
    plain = dialect_relay(dialect)
    assert SECRET.encode() in run_reads(plain, [stream.encode()])  # the problem
    r = dialect_relay(dialect, rules)
    out = run_reads(r, [stream.encode()])
    assert SECRET[8:20].encode() not in out
    assert r.end_state is EndState.BLOCKED


def test_an_ndjson_line_with_a_done_key_and_text_elsewhere_blocks() -> None:
    line = json.dumps({"token": f"key {SECRET}", "done": False}) + "\n"
    r = dialect_relay("ndjson", BLOCK)
    out = run_reads(r, [line.encode()])
    assert SECRET.encode() not in out and r.end_state is EndState.BLOCKED


@pytest.mark.parametrize(
    "data",
    [
        # A lone surrogate: valid JSON text, no UTF-8 to write it back in.
        '{"choices":[{"index":0,"delta":{"content":"\\ud800 key ' + SECRET + '"}}]}',
        # Deep enough that one parser takes it and the other does not.
        '{"choices":[{"index":0,"delta":{"content":"key '
        + SECRET
        + '"}}],"x":'
        + "[" * 1010
        + "]" * 1010
        + "}",
    ],
    ids=["lone-surrogate", "depth-1010"],
)
def test_an_event_that_cannot_be_written_again_redacted_fails_closed(data: str) -> None:
    r = dialect_relay("openai-chat", REDACT)
    out = run_reads(r, [f"data: {data}\n\ndata: [DONE]\n\n".encode()])
    assert SECRET.encode() not in out
    assert r.end_state is EndState.BLOCKED


@pytest.mark.parametrize("pattern", [r"ab\Kcd", r"(?r)ab{1,2}", r"(?:ab){e<=1}", r"(?b)abc"])
def test_regex_only_searches_that_a_cut_would_change_are_refused(pattern: str) -> None:
    with pytest.raises(FilterError, match="only the regex module has"):
        compile_filters((FilterRule("regex", pattern, "redact", "p", 16),), False)


def test_unicode_properties_are_still_taken() -> None:
    rules = (FilterRule("regex", r"\p{Lu}{3}-\d{4}", "redact", "code"),)
    assert _answer(rules, list("code ABC-1234 ok"))[0] == f"code {REDACTED} ok"


def test_cuts_in_an_event_of_many_parts_are_made_in_one_pass() -> None:
    from streamwarden.core.filters import apply_cuts

    parts = [f"p{i}-secret " for i in range(200)]
    offsets = []
    at = 0
    for part in parts:
        offsets.append((at + 3 if len(part) > 3 else at, at + len(part) - 1, REDACTED))
        at += len(part)
    made = apply_cuts(parts, offsets)
    assert made[0] == "p0-" + REDACTED + " " and made[150] == "p15" + REDACTED + " "
    assert made[150] == apply_cuts([parts[150]], [(3, len(parts[150]) - 1, REDACTED)])[0]

    def lines(count: int) -> int:
        seen = 0
        code = apply_cuts.__code__

        def tracer(frame: FrameType, event: str, arg: Any) -> Any:
            nonlocal seen
            if frame.f_code is code and event == "line":
                seen += 1
            return tracer

        sys.settrace(tracer)
        try:
            apply_cuts(parts[:count], offsets[:count])
        finally:
            sys.settrace(None)
        return seen

    # Twice the parts and cuts, about twice the work: not four times.
    assert lines(200) < 2.2 * lines(100)
