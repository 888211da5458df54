"""Output filters in the core: the matcher, and the relay holding whole events around a match.

Every stream here is built from text pieces by one writer per dialect
(``filter_streams.py``), the way its provider writes it (compact JSON), so
the expected output of a filtered stream can be built by the same writer
from pieces redacted by hand: an event the match does not touch must come out byte for byte as it
went in, and the one a match begins in must differ only in its text.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from filter_streams import (
    BLOCK,
    DIALECTS,
    LIMITS,
    LINES,
    REDACT,
    SECRET,
    TEXT,
    Writer,
    anthropic,
    compact_json,
    events_of,
    generic,
    json_lines,
    openai_chat,
    redacted_pieces,
    relay,
    responses,
    run,
    split_secret,
)
from locations import REPO, STREAMS
from streamwarden.config import ConfigError, load_settings
from streamwarden.core.dialects import sniff
from streamwarden.core.filters import REDACTED, FilterRule, compile_filters, luhn_valid
from streamwarden.core.meter import EndState
from streamwarden.core.relay import KEEPALIVE, Limits, Relay
from streamwarden.core.sse import LineFramer, SSEDecoder, SSEFramer
from streamwarden.core.usage import TakeBack
from streamwarden.pipeline.transforms import with_transforms

CARD = "4111 1111 1111 1111"  # the classic Luhn-valid test number


# -- the matcher on its own -------------------------------------------------------------


def test_without_filters_the_secret_reaches_the_client() -> None:
    stream = openai_chat(split_secret(TEXT, SECRET, 3))
    out = run(relay("openai-chat"), [stream])
    assert out == stream
    assert SECRET in chat_text(out)  # the whole problem: split, it passes any per-event check
    assert all(SECRET not in e.data for e in SSEDecoder().feed(out))


def chat_text(stream: bytes) -> str:
    """The answer an OpenAI client reads from a Chat Completions stream."""
    events = SSEDecoder().feed(stream)
    return "".join(
        json.loads(e.data)["choices"][0]["delta"]["content"] for e in events if e.data != "[DONE]"
    )


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("events", [2, 3, 10])
def test_a_secret_split_across_events_is_redacted_and_every_other_byte_is_unchanged(
    dialect: str, events: int
) -> None:
    writer = DIALECTS[dialect][0]
    pieces = split_secret(TEXT, SECRET, events)
    assert sum(1 for p in pieces if set(p) & set(SECRET[3:])) >= events
    stream = writer(pieces)
    expected = writer(redacted_pieces(pieces, SECRET))
    r = relay(dialect, REDACT)
    # One read, and one event per read.
    assert run(r, [stream]) == expected
    assert r.end_state is EndState.COMPLETED
    frames = SSEDecoder().feed(stream) if dialect not in LINES else None
    one_by_one = relay(dialect, REDACT)
    reads = [f.encode() for f in events_of(stream, dialect)]
    assert run(one_by_one, reads) == expected
    assert frames is None or len(frames) >= events
    stats = one_by_one.meter.filters
    assert stats is not None and stats.matches == {("secrets", "redact"): 1}
    assert stats.held_bytes > 0 and stats.hold_times


@pytest.mark.parametrize("dialect", ["openai-chat", "anthropic", "ndjson"])
def test_every_byte_position_of_a_read_boundary_gives_the_same_redacted_stream(
    dialect: str,
) -> None:
    writer = DIALECTS[dialect][0]
    pieces = split_secret(TEXT, SECRET, 3)
    stream = writer(pieces)
    expected = writer(redacted_pieces(pieces, SECRET))
    for cut in range(1, len(stream)):
        r = relay(dialect, REDACT)
        assert run(r, [stream[:cut], stream[cut:]]) == expected, cut
    bytewise = relay(dialect, REDACT)
    assert run(bytewise, [stream[i : i + 1] for i in range(len(stream))]) == expected


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_a_block_match_ends_the_stream_with_content_blocked_after_the_events_before_it(
    dialect: str,
) -> None:
    writer = DIALECTS[dialect][0]
    pieces = split_secret(TEXT, SECRET, 3)
    stream = writer(pieces)
    r = relay(dialect, BLOCK)
    out = run(r, [stream])
    assert r.end_state is EndState.BLOCKED
    assert r.meter.error_code == "content_blocked"
    # The events before the one the secret begins in, exactly the upstream's bytes, then
    # the dialect's error event, and nothing after it.
    start = TEXT.index(SECRET)
    first = next(i for i in range(len(pieces)) if len("".join(pieces[: i + 1])) > start)
    assert first > 0  # some text goes out before the secret
    prefix = _before(writer, pieces[:first], dialect)
    message = "streamwarden: an output filter (secrets) blocked the answer (content_blocked)"
    assert out == prefix + r._dialect.error_event("content_blocked", message)


def _before(writer: Writer, pieces: list[str], dialect: str) -> bytes:
    """The bytes a writer sends before the event of the first piece not in ``pieces``."""
    events = events_of(writer([*pieces, "."]), dialect)
    closing = {"openai-chat": 1, "anthropic": 2, "openai-responses": 4, "ndjson": 1, "cohere": 2}
    kept = events[
        : len(events) - closing.get(dialect, 0 if dialect in ("gemini", "tgi") else 1) - 1
    ]
    if dialect in ("generic", "ndjson-text"):
        kept = events[:-1]
    return "".join(kept).encode()


def test_a_near_miss_is_released_as_soon_as_it_cannot_match() -> None:
    r = relay("openai-chat", REDACT)
    chunk = openai_chat(["the prefix sk-ab"])[: -len(b"data: [DONE]\n\n")]
    assert r.feed(chunk, 1.0) == b""  # "sk-ab" could begin a key: the event waits
    assert r.meter.filters is not None and r.meter.filters.held_bytes == len(chunk)
    after = openai_chat([" is not a key"])[: -len(b"data: [DONE]\n\n")]
    assert r.feed(after, 2.0) == chunk + after  # the space rules it out: both go, unchanged
    assert r.meter.filters.hold_times == [1.0]
    # Text that cannot begin a match is never held.
    plain = openai_chat(["no prefix here."])[: -len(b"data: [DONE]\n\n")]
    assert r.feed(plain, 3.0) == plain


def test_events_without_text_wait_behind_held_text_and_leave_in_order() -> None:
    r = relay("anthropic", REDACT)
    stream = anthropic(["see sk-"])
    events = events_of(stream, "anthropic")
    out = b"".join(r.feed(e.encode(), 1.0) for e in events[:3])
    assert out == "".join(events[:2]).encode()  # the delta ending in "sk-" waits
    assert r.feed(events[3].encode(), 2.0) == b""  # content_block_stop waits behind it
    # message_stop is terminal: no more text comes, so what waits is decided and goes.
    assert r.feed(events[4].encode(), 3.0) == "".join(events[2:]).encode()
    assert r.upstream_eof(4.0) == b""
    assert r.end_state is EndState.COMPLETED


def test_the_end_of_the_stream_releases_what_is_left_or_blocks_if_it_completes_a_match() -> None:
    cut = openai_chat(["the key ", SECRET[:12]])[: -len(b"data: [DONE]\n\n")]
    r = relay("generic", REDACT)
    # generic: no terminal event; a clean end releases the held "sk-proj-..." prefix.
    generic_stream = generic(["the key ", SECRET[:12]])
    assert run(r, [generic_stream]) == generic_stream
    # The whole key as the last text: the end completes the match.
    r = relay("generic", BLOCK)
    out = run(r, [generic(["the key ", SECRET])])
    assert out.startswith(generic(["the key "])) and b"content_blocked" in out
    assert r.end_state is EndState.BLOCKED
    r = relay("generic", REDACT)
    assert run(r, [generic(["the key ", SECRET])]) == generic(["the key ", REDACTED])
    # openai-chat cut before [DONE]: the held text goes out before stream_truncated.
    r = relay("openai-chat", REDACT)
    out = run(r, [cut])
    assert out.startswith(cut) and b"stream_truncated" in out[len(cut) :]


def test_keepalives_go_out_between_whole_events_while_text_waits() -> None:
    r = relay("openai-chat", REDACT)
    held = openai_chat(["key: sk-"])[: -len(b"data: [DONE]\n\n")]
    assert r.feed(held, 1.0) == b""
    assert r.poll(17.0) == KEEPALIVE
    assert r.feed(openai_chat([" no"]), 18.0) == held + openai_chat([" no"])


def test_redacting_keeps_every_field_of_the_event_but_the_text() -> None:
    r = relay("openai-chat", REDACT)
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1733,
        "model": "gpt-x",
        "choices": [{"index": 0, "delta": {"content": f"k={SECRET}!"}, "logprobs": None}],
    }
    stream = f"id: 7\ndata: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    out = run(r, [stream])
    first = SSEDecoder().feed(out)[0]
    assert first.id == "7"
    got = json.loads(first.data)
    chunk["choices"][0]["delta"]["content"] = f"k={REDACTED}!"  # type: ignore[index]
    assert got == chunk


def test_tool_call_arguments_are_filtered_only_when_configured() -> None:
    call = {"index": 0, "function": {"arguments": '{"key": "' + SECRET + '"}'}}
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
    stream = f"data: {compact_json(chunk)}\n\ndata: [DONE]\n\n".encode()
    assert run(relay("openai-chat", REDACT), [stream]) == stream
    out = run(relay("openai-chat", REDACT, tools=True), [stream])
    args = json.loads(SSEDecoder().feed(out)[0].data)["choices"][0]["delta"]["tool_calls"][0]
    assert json.loads(args["function"]["arguments"]) == {"key": REDACTED}


@pytest.mark.parametrize("dialect", [*DIALECTS, "ndjson-json"])
def test_a_key_whole_in_one_event_is_redacted_in_every_dialect(dialect: str) -> None:
    # ndjson-json: lines in no Ollama shape are read whole, as text, and redacted there.
    writer = json_lines if dialect == "ndjson-json" else DIALECTS[dialect][0]
    line = f"key {SECRET} end"
    out = run(relay("ndjson" if dialect == "ndjson-json" else dialect, REDACT), [writer([line])])
    assert out == writer([f"key {REDACTED} end"])
    assert _key_pieces_in(out) == []  # no part of the key's body


def _with_usage_null(stream: bytes) -> bytes:
    """A Chat Completions stream as the upstream sends it when asked for usage."""
    chunks = stream.replace(b"]}\n\n", b'],"usage":null}\n\n')
    usage = b'data: {"id":"c1","choices":[],"usage":{"completion_tokens":3}}\n\n'
    return chunks.replace(b"data: [DONE]", usage + b"data: [DONE]")


def test_with_usage_injection_a_redacted_event_gains_no_usage_field() -> None:
    pieces = split_secret(TEXT, SECRET, 3)
    upstream = _with_usage_null(openai_chat(pieces))
    assert upstream.count(b'"usage":null') == len(pieces)

    def injected(rules: tuple[FilterRule, ...]) -> Relay:  # as usage_injection: auto makes it
        return relay("openai-chat", rules, usage=TakeBack())

    # Unfiltered, the client gets the stream as if it had never asked for usage...
    assert run(injected(()), [upstream]) == openai_chat(pieces)
    # ...and redacted, that same stream with only the text changed.
    r = injected(REDACT)
    assert run(r, [upstream]) == openai_chat(redacted_pieces(pieces, SECRET))
    assert r.meter.usage_tokens == 3


def test_cards_are_luhn_checked() -> None:
    cards = (FilterRule("builtin", "cards", "redact", "cards"),)
    assert luhn_valid(CARD) and not luhn_valid("4111 1111 1111 1112")
    stream = generic([f"pay {CARD[:7]}", f"{CARD[7:]} now; not 4111 1111 1111 1112"])
    out = run(relay("generic", cards), [stream])
    assert out == generic([f"pay {REDACTED}", " now; not 4111 1111 1111 1112"])


def test_literals_and_bounded_regexes() -> None:
    rules = (
        FilterRule("literal", "acme-internal.corp", "redact", "hosts"),
        FilterRule("regex", r"TICKET-\d{4,8}", "redact", "tickets"),
        FilterRule("regex", r"ACME\d+", "block", "acme", max_length=12),
    )
    stream = generic(["host acme-inte", "rnal.corp, TICKET-12", "345 ok"])
    r = relay("generic", rules)
    assert run(r, [stream]) == generic([f"host {REDACTED}", f", {REDACTED}", " ok"])
    assert r.meter.filters is not None
    assert r.meter.filters.matches == {("hosts", "redact"): 1, ("tickets", "redact"): 1}
    blocked = relay("generic", rules)
    assert b"content_blocked" in run(blocked, [generic(["x ACME", "123456789012345"])])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"regex": "a+b", "action": "redact"}, "has no bounded match length"),
        ({"regex": "a(", "action": "redact"}, "is not a regular expression"),
        ({"regex": "a*", "action": "redact"}, "matches empty text"),
        ({"builtin": "keys", "action": "redact"}, "is not a built-in set"),
        ({"literal": "x", "regex": "y", "action": "redact"}, "exactly one of"),
        ({"literal": "x"}, "output_filters.1.action: is required"),
        ({"literal": "x", "action": "hide"}, "is not one of"),
        ({"literal": "x", "action": "block", "max_length": 3}, "applies to a regex only"),
    ],
)
def test_a_bad_filter_is_a_config_error_naming_the_entry(
    entry: dict[str, Any], message: str
) -> None:
    good = {"builtin": "secrets", "action": "block"}
    with pytest.raises(ConfigError, match=r"output_filters\.1") as caught:
        load_settings(environ={}, overrides={"output_filters": [good, entry]})
    assert message in str(caught.value)


def test_routes_choose_their_filters_and_a_route_without_them_has_none() -> None:
    settings = load_settings(
        environ={},
        overrides={
            "output_filters": [{"builtin": "secrets", "action": "redact"}],
            "routes": {"/open": {"output_filters": []}},
        },
    )
    assert settings.for_path("/v1/chat/completions").output_filters is not None
    assert settings.for_path("/open/x").output_filters is None
    # Compiled once, not per request.
    assert settings.for_path("/a").output_filters is settings.for_path("/b").output_filters
    assert load_settings(environ={}).for_path("/").output_filters is None


# -- properties ---------------------------------------------------------------------------

_WORDS = st.sampled_from(["the ", "sk", "-", "s", "a", " ", "4111", "k", "AKIA", "x", "\n"])


@settings(max_examples=150, deadline=None)
@given(
    before=st.lists(_WORDS, max_size=12).map("".join),
    after=st.lists(_WORDS, max_size=12).map("".join),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_how_the_text_is_cut_into_events_never_changes_what_the_client_reads(
    before: str, after: str, cuts: list[int]
) -> None:
    """Chunking invariance: the text as read equals the text redacted in one piece."""
    text = before + " " + SECRET + after  # keys are matched where a word begins
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    whole = run(relay("openai-chat", REDACT), [openai_chat([text])])
    split = run(relay("openai-chat", REDACT), [openai_chat(pieces)])

    assert chat_text(split) == chat_text(whole)
    assert SECRET not in chat_text(split) and REDACTED in chat_text(split)


class _Sink:
    def __init__(self) -> None:
        self.events: list[bytes] = []

    def append(self, seq: int, data: bytes) -> None:
        self.events.append(data)

    def end(self, state: str, dialect: str) -> None:
        pass


@pytest.mark.parametrize("detached", [False, True])
def test_the_journal_keeps_what_the_client_gets_redacted_and_in_order(detached: bool) -> None:
    from streamwarden.features.resume.model import Journal

    sink = _Sink()
    r = with_transforms(relay("openai-chat", REDACT), journal=Journal("s1", sink))
    events = events_of(openai_chat(split_secret(TEXT, SECRET, 3)), "openai-chat")
    if detached:  # the client left: the stream runs on into its journal for a resume
        r.lifecycle.detach_for(99.5)
        r.client_gone(0.5)
    out = b"".join(r.feed(e.encode(), float(i)) for i, e in enumerate(events))
    out += r.upstream_eof(50.0)
    if detached:
        assert out == b""  # nobody to write to; the journal has it all
    else:
        assert b"".join(sink.events) == out
    stored = b"".join(sink.events).decode()
    assert SECRET not in chat_text(stored.encode()) and REDACTED in chat_text(stored.encode())
    assert [e.id for e in SSEDecoder().feed(stored.encode())] == [
        f"s1.{i}" for i in range(1, len(events) + 1)
    ]


# -- recorded streams of every dialect ------------------------------------------------------

_MANIFEST: dict[str, dict[str, Any]] = json.loads((STREAMS / "manifest.json").read_text())


def _recorded_relay(name: str, rules: tuple[FilterRule, ...], tools: bool) -> Relay:
    entry = _MANIFEST[name]
    return with_transforms(
        Relay(
            LIMITS,
            started_at=0.0,
            now=0.0,
            path=entry["request_path"],
            content_type=entry["content_type"],
            headers=entry["headers"],
            framing=entry["framing"],
        ),
        filters=compile_filters(rules, tools),
    )


def _texts(name: str, stream: bytes, tools: bool) -> str:
    """What the filters read of a stream, event by event, with the dialect's own walker."""
    entry = _MANIFEST[name]
    r = _recorded_relay(name, (), False)
    framer = LineFramer() if entry["framing"] == "lines" else SSEFramer()
    frames = framer.feed(stream)
    dialect = r._dialect
    out = []
    for frame in frames:
        if frame.event is not None:
            dialect = sniff(frame.event, dialect) if dialect.name == "generic" else dialect
            out += dialect.filter_text(frame.event, tools)
    return "".join(out)


@pytest.mark.parametrize("name", sorted(_MANIFEST))
def test_recorded_streams_pass_unchanged_and_the_dialect_text_is_the_filtered_text(
    name: str,
) -> None:
    stream = (STREAMS / name).read_bytes()
    for tools in (False, True):
        r = _recorded_relay(name, (*REDACT, FilterRule("builtin", "cards", "block", "c")), tools)
        assert run(r, [stream]) == stream  # no false positive on a real answer
        assert r.end_state is EndState.COMPLETED
    # The meter's text and the filters' text come from one walk of each event.
    entry = _MANIFEST[name]
    r = _recorded_relay(name, (), False)
    framer = LineFramer() if entry["framing"] == "lines" else SSEFramer()
    for frame in framer.feed(stream):
        if frame.event is None:
            continue
        if r._provisional:
            r._dialect = sniff(frame.event, r._dialect)
            r._provisional = False
        seen = r._dialect.inspect(frame.event)
        if seen.text and not seen.tools:
            assert "".join(r._dialect.filter_text(frame.event, False)) == seen.text
        if seen.tools and r._dialect.name != "gemini":
            assert "".join(r._dialect.filter_text(frame.event, True)) == seen.text


@pytest.mark.parametrize("name", sorted(_MANIFEST))
def test_a_literal_in_a_recorded_answer_is_redacted_and_tool_arguments_only_when_asked(
    name: str,
) -> None:
    stream = (STREAMS / name).read_bytes()
    entry = _MANIFEST[name]
    cafe = (FilterRule("literal", "café", "redact", "cafe"),)
    out = run(_recorded_relay(name, cafe, False), [stream])
    if "café" not in entry["text"] and "café" not in _texts(name, stream, True):
        assert out == stream
        return
    assert _texts(name, out, False) == _texts(name, stream, False).replace("café", REDACTED)
    assert _texts(name, out, True).count(REDACTED) == _texts(name, stream, False).count("café")
    both = run(_recorded_relay(name, cafe, True), [stream])
    assert "café" not in _texts(name, both, True)
    assert _texts(name, both, True) == _texts(name, stream, True).replace("café", REDACTED)


def test_events_held_past_max_event_bytes_end_the_stream_closed() -> None:
    limits = Limits(15.0, 60.0, 1800.0, 4096)
    r = with_transforms(
        Relay(
            limits,
            started_at=0.0,
            now=0.0,
            path="/v1/chat/completions",
            content_type="text/event-stream",
            headers={},
        ),
        filters=compile_filters(REDACT, False),
    )
    held = openai_chat(["the key sk-"])[: -len(b"data: [DONE]\n\n")]
    assert r.feed(held, 1.0) == b""
    ping = b'data: {"choices":[]}\n\n'  # no text: waits behind the held prefix
    out = b""
    for i in range(4096 // len(ping) + 2):
        out += r.feed(ping, 2.0 + i)
        if r.done:
            break
    assert r.end_state is EndState.BLOCKED
    assert b"content_blocked" in out and b"exceeded 4096 bytes" in out
    assert b"sk-" not in out


def test_check_config_names_the_bad_filter_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "filters.yaml"
    bad.write_text(
        "output_filters:\n  - {builtin: secrets, action: block}\n"
        "routes:\n  /v1/chat:\n    output_filters:\n      - {regex: 'ACME-\\d+', action: redact}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "streamwarden.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "streamwarden: error: routes./v1/chat.output_filters.0: output filter: regex `ACME-\\d+`"
        " has no bounded match length (at most 4096): write {m,n} instead of +, * or {m,},"
        " or give max_length"
    ]


def test_a_regex_with_its_own_flags_and_groups_keeps_them_to_itself() -> None:
    rules = (
        FilterRule("regex", r"(?i)acme-(\d{2})-\1", "redact", "acme"),
        FilterRule("literal", "Secret", "redact", "word"),
    )
    stream = generic(["ACME-12-12 and acme-34-", "34, Secret and secret"])
    out = run(relay("generic", rules), [stream])
    # (?i) makes the regex case-blind, not the literal; \\1 still refers to its group.
    assert out == generic([f"{REDACTED} and {REDACTED}", f", {REDACTED} and secret"])


_MIXED = st.sampled_from(
    ["4111", " 1111", "-", " ", "acme", "-internal", ".corp", "sk-", "Q7eXg9TzK2mLw4RbN8vY", "x"]
)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(_MIXED, max_size=24).map("".join), cuts=st.lists(st.integers(0, 400)))
# A card-shaped run inside a key still arriving (found by a reviewer's fuzzer).
@example(text="sk-" + "4111" * 4 + "Q7eXg9TzK2mLw4RbN8vY" + " x" * 10, cuts=[19])
def test_cards_literals_and_keys_give_the_same_answer_however_the_text_is_cut(
    text: str, cuts: list[int]
) -> None:
    rules = (
        FilterRule("builtin", "cards", "redact", "cards"),
        FilterRule("literal", "acme-internal.corp", "redact", "hosts"),
        FilterRule("builtin", "secrets", "block", "secrets"),
    )
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    whole = relay("openai-chat", rules)
    whole_out = run(whole, [openai_chat([text])])
    split = relay("openai-chat", rules)
    split_out = run(split, [openai_chat(pieces)])
    assert split.end_state == whole.end_state
    if whole.end_state is EndState.COMPLETED:
        assert chat_text(split_out) == chat_text(whole_out)
        assert "acme-internal.corp" not in chat_text(split_out)
    else:
        assert whole.end_state is EndState.BLOCKED
        released = chat_text_before_error(split_out)
        assert "sk-Q7eXg9TzK2mLw4RbN8vY" not in released
        assert "acme-internal.corp" not in released
        assert split_out.endswith(split._dialect.error_event("content_blocked", BLOCK_MESSAGE))


BLOCK_MESSAGE = "streamwarden: an output filter (secrets) blocked the answer (content_blocked)"


def chat_text_before_error(stream: bytes) -> str:
    events = [e for e in SSEDecoder().feed(stream) if '"error"' not in e.data]
    return chat_text(b"".join(f"data: {e.data}\n\n".encode() for e in events))


def test_the_docs_example_is_a_valid_config(tmp_path: Path) -> None:
    section = (REPO / "docs" / "filters.md").read_text()
    start = section.index("```yaml\n") + len("```yaml\n")
    example = tmp_path / "example.yaml"
    example.write_text(section[start : section.index("```", start)])
    settings = load_settings(example, environ={})
    filters = settings.for_path("/v1/chat/completions").output_filters
    assert filters is not None and len(filters.rules) == 5


# -- summary events that repeat the whole text ------------------------------------------------


def _key_pieces_in(out: bytes) -> list[str]:
    """The six-character pieces of the key's body (past ``sk-proj-``) that ``out`` holds."""
    body = SECRET[8:]
    text = out.decode()
    return [body[i : i + 6] for i in range(len(body) - 5) if body[i : i + 6] in text]


def _responses_with_key() -> bytes:
    """The recorded Responses stream with the key written into its answer, over two deltas.

    The deltas carry it in two pieces; ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done`` and
    ``response.completed`` each carry the whole text again.
    """
    recorded = (STREAMS / "openai_responses_text.sse").read_text()
    stream = (
        recorded.replace('"delta":"ïve"', f'"delta":"ïve {SECRET[:12]}"')
        .replace('"delta":" café"', f'"delta":"{SECRET[12:]} café"')
        .replace("naïve café", f"naïve {SECRET} café")
    )
    assert stream.count(SECRET) == 4 and stream.count(SECRET[12:]) == 5
    return stream.encode()


def _responses_answer(stream: bytes) -> tuple[str, list[str]]:
    """The deltas' text, and every whole text the summary events carry (what the SDK reads)."""
    deltas = ""
    wholes: list[str] = []
    for event in SSEDecoder().feed(stream):
        data = json.loads(event.data)
        kind = data["type"]
        if kind == "response.output_text.delta":
            deltas += data["delta"]
        elif kind == "response.output_text.done":
            wholes.append(data["text"])
        elif kind == "response.content_part.done":
            wholes.append(data["part"]["text"])
        elif kind == "response.output_item.done":
            wholes.append(data["item"]["content"][0]["text"])
        elif kind == "response.completed":
            wholes.append(data["response"]["output"][0]["content"][0]["text"])
    return deltas, wholes


@pytest.mark.parametrize("named", [True, False])
def test_the_responses_summary_events_carry_the_redacted_text_not_the_key(named: bool) -> None:
    stream = _responses_with_key()
    if not named:  # a server that writes no event: lines (the type is in the data)
        stream = re.sub(rb"^event: [^\n]*\n", b"", stream, flags=re.M)
    deltas, wholes = _responses_answer(stream)
    assert SECRET in deltas and wholes == [deltas] * 4  # the Responses API repeats it
    r = _recorded_relay("openai_responses_text.sse", REDACT, False)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _key_pieces_in(out) == []  # no part of the key, anywhere
    deltas, wholes = _responses_answer(out)
    assert REDACTED in deltas and wholes == [deltas] * 4
    # Each summary event differs from the upstream's only in its text.
    sent = SSEDecoder().feed(stream)
    for before, after in zip(sent, SSEDecoder().feed(out), strict=True):
        assert after.event == before.event
        assert after.data == before.data.replace(SECRET, REDACTED).replace(
            SECRET[:12], REDACTED
        ).replace(SECRET[12:], "")
    # One match counted, not one per repetition.
    assert r.meter.filters is not None
    assert r.meter.filters.matches == {("secrets", "redact"): 1}


def test_a_key_only_a_summary_event_carries_is_blocked_or_redacted_there() -> None:
    # An upstream whose deltas never carried it: the whole text is filtered on its own.
    stream = responses(["the key is ", "not here"]).replace(
        b'"text":"the key is not here"', f'"text":"the key is {SECRET}"'.encode()
    )
    assert stream.count(SECRET.encode()) == 4
    r = relay("openai-responses", REDACT)
    out = run(r, [stream])
    assert r.end_state is EndState.COMPLETED
    assert _key_pieces_in(out) == [] and out.count(REDACTED.encode()) == 4
    blocked = relay("openai-responses", BLOCK)
    out = run(blocked, [stream])
    assert blocked.end_state is EndState.BLOCKED and blocked.meter.error_code == "content_blocked"
    assert _key_pieces_in(out) == [] and b"(secrets) blocked" in out
    assert out.startswith(b"".join(e.encode() for e in events_of(stream, "openai-responses")[:3]))


def test_tool_arguments_repeated_whole_are_filtered_when_tool_arguments_are() -> None:
    recorded = (STREAMS / "openai_responses_tool_call.sse").read_text()
    # Only in the whole arguments (the deltas cut "naïve café" in pieces): the .done
    # event, the output item and the response carry it.
    stream = recorded.replace("naïve café", f"naïve {SECRET} café").encode()
    assert stream.count(SECRET.encode()) == 3
    left = run(_recorded_relay("openai_responses_tool_call.sse", REDACT, False), [stream])
    assert left == stream  # tool arguments are not read unless asked
    out = run(_recorded_relay("openai_responses_tool_call.sse", REDACT, True), [stream])
    assert _key_pieces_in(out) == [] and out.count(REDACTED.encode()) == 3
    for event in SSEDecoder().feed(out):  # and the arguments are still JSON
        data = json.loads(event.data)
        if event.event == "response.function_call_arguments.done":
            assert json.loads(data["arguments"])["body"].startswith(f"naïve {REDACTED} café")


@pytest.mark.parametrize(
    ("name", "delta", "whole"),
    [
        # AI SDK 4: the c: deltas, then the 9: tool call with its args whole, as an object.
        ("vercel_data_stream.txt", '"argsTextDelta":"ich"', '"args":{"city":"Zürich"}'),
        # AI SDK 5: tool-input-delta, then tool-input-available with its input whole.
        ("vercel_ui_message_stream.sse", '"inputTextDelta":"東京"', '"input":{"city":"東京"}'),
    ],
)
def test_vercel_tool_input_repeated_whole_is_filtered_with_the_deltas(
    name: str, delta: str, whole: str
) -> None:
    recorded = (STREAMS / name).read_text()
    city = whole.split('"city":"')[1].rstrip('"}')
    stream = recorded.replace(delta, delta[:-1] + f' {SECRET}"', 1).replace(
        whole, whole.replace(city, f"{city} {SECRET}"), 1
    )
    assert stream.count(SECRET) == 2
    left = run(_recorded_relay(name, REDACT, False), [stream.encode()])
    assert left == stream.encode()  # tool arguments are not read unless asked
    out = run(_recorded_relay(name, REDACT, True), [stream.encode()])
    assert _key_pieces_in(out) == [] and out.count(REDACTED.encode()) == 2
    # The whole input says what the deltas say: the city, then [redacted].
    assert f'"city":"{city} {REDACTED}"'.encode() in out
