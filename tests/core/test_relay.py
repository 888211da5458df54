"""The relay state machine: end states, synthesized errors, keep-alive scheduling, metering."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from streamwarden.core.relay import KEEPALIVE, Limits, Relay
from streamwarden.core.sse import SSEDecoder

LIMITS = Limits(
    keepalive_interval=1.0,
    upstream_idle_timeout=5.0,
    max_stream_duration=100.0,
    max_event_bytes=1024,
)


def chunk(text: str) -> bytes:
    return f'data: {{"choices":[{{"index":0,"delta":{{"content":"{text}"}}}}]}}\n\n'.encode()


USAGE = b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"


def new_relay(limits: Limits = LIMITS, path: str = "/v1/chat/completions") -> Relay:
    return Relay(
        limits,
        started_at=0.0,
        now=0.0,
        path=path,
        content_type="text/event-stream",
        headers={},
    )


@dataclass
class Case:
    name: str
    script: Callable[[Relay], bytes]
    end_state: str
    code: str | None


def _complete(r: Relay) -> bytes:
    return r.feed(chunk("a") + USAGE + DONE, 0.1) + r.upstream_eof(0.2)


def _truncated_at_boundary(r: Relay) -> bytes:
    return r.feed(chunk("a"), 0.1) + r.upstream_eof(0.2)


def _truncated_mid_event(r: Relay) -> bytes:
    return r.feed(chunk("a") + b'data: {"choi', 0.1) + r.upstream_eof(0.2)


def _reset(r: Relay) -> bytes:
    return r.feed(chunk("a"), 0.1) + r.upstream_failed(0.2)


def _idle(r: Relay) -> bytes:
    out = r.feed(chunk("a"), 0.1)
    now = 0.1
    while not r.done:
        deadline = r.deadline
        assert deadline is not None
        now = deadline
        out += r.poll(now)
    assert now == pytest.approx(5.1)
    return out


def _duration(r: Relay) -> bytes:
    out = b""
    for i in range(1000):  # an upstream that never stops talking
        out += r.feed(chunk("a"), i * 0.5)
        out += r.poll(i * 0.5)
        if r.done:
            break
    return out


def _too_large(r: Relay) -> bytes:
    return r.feed(chunk("a") + b"data: " + b"x" * 2000, 0.1)


def _client_gone(r: Relay) -> bytes:
    out = r.feed(chunk("a"), 0.1)
    r.client_gone(0.2)
    return out


def _slow_client(r: Relay) -> bytes:
    out = r.feed(chunk("a"), 0.1)
    r.client_too_slow(0.2)
    return out


def _shutdown(r: Relay) -> bytes:
    return r.feed(chunk("a"), 0.1) + r.shutdown(0.2)


def _client_gone_after_terminal(r: Relay) -> bytes:
    out = r.feed(chunk("a") + DONE, 0.1)
    r.client_gone(0.2)
    return out


def _reset_after_terminal(r: Relay) -> bytes:
    return r.feed(chunk("a") + DONE, 0.1) + r.upstream_failed(0.2)


def _upstream_reports_error(r: Relay) -> bytes:
    error = b'data: {"error":{"message":"overloaded","type":"server_error"}}\n\n'
    return r.feed(chunk("a") + error, 0.1) + r.upstream_eof(0.2)


CASES = [
    Case("completed", _complete, "completed", None),
    Case(
        "truncated at an event boundary",
        _truncated_at_boundary,
        "upstream_truncated",
        "stream_truncated",
    ),
    Case("truncated mid-event", _truncated_mid_event, "upstream_truncated", "stream_truncated"),
    Case("reset mid-stream", _reset, "upstream_error", "upstream_error"),
    Case("silent upstream", _idle, "upstream_timeout", "upstream_timeout"),
    Case("stream too long", _duration, "limit_exceeded", "duration_exceeded"),
    Case("event too large", _too_large, "limit_exceeded", "event_too_large"),
    Case("client disconnects", _client_gone, "client_cancelled", None),
    Case("client too slow", _slow_client, "client_too_slow", None),
    Case("process draining", _shutdown, "shutdown", "shutting_down"),
    Case("client leaves after [DONE]", _client_gone_after_terminal, "completed", None),
    Case("reset after [DONE]", _reset_after_terminal, "completed", None),
    Case("upstream sends its own error", _upstream_reports_error, "upstream_error", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_ending_has_one_end_state_and_the_right_error_event(case: Case) -> None:
    relay = new_relay()
    out = case.script(relay)
    assert relay.done
    assert relay.end_state == case.end_state
    assert relay.meter.error_code == case.code
    events = SSEDecoder().feed(out)
    synthesized = [e for e in events if '"type":"stream_error"' in e.data]
    if case.code is None:
        assert synthesized == []
    else:
        (error,) = synthesized
        assert synthesized[-1] is events[-1]  # the error is the last thing written
        assert json.loads(error.data)["error"]["code"] == case.code
    # Nothing more comes out, and the end state never changes again.
    assert relay.feed(chunk("late"), 200.0) == b""
    assert relay.upstream_eof(200.0) == b""
    assert relay.upstream_failed(200.0) == b""
    assert relay.poll(200.0) == b""
    assert relay.shutdown(200.0) == b""
    relay.client_gone(200.0)
    assert relay.end_state == case.end_state


def truncation_message(path: str, content_type: str, upstream: bytes, dialect: str) -> str:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path=path,
        content_type=content_type,
        headers={},
        dialect=dialect,
    )
    relay.feed(upstream, 0.1)
    out = relay.upstream_eof(0.2)
    assert relay.meter.error_code == "stream_truncated"
    data = SSEDecoder().feed(out)[0].data if content_type == "text/event-stream" else out
    message = json.loads(data)["error"]
    return message["message"] if isinstance(message, dict) else str(message)


@pytest.mark.parametrize(
    ("dialect", "content_type", "upstream", "expected"),
    [
        # Ended between events, before the terminal event the dialect promises.
        (
            "openai-chat",
            "text/event-stream",
            chunk("a"),
            "streamwarden: the upstream ended the stream without data: [DONE] (stream_truncated)",
        ),
        # Ended inside an event, in a dialect that has no terminal event: the
        # only thing wrong is the unfinished event, so that is what it says.
        (
            "generic",
            "text/event-stream",
            b"data: a\n\ndata: b",
            "streamwarden: the upstream ended the stream inside an unfinished event"
            " (stream_truncated)",
        ),
        # Inside an event, before the terminal event: both are said.
        (
            "openai-chat",
            "text/event-stream",
            chunk("a") + b'data: {"choi',
            "streamwarden: the upstream ended the stream inside an unfinished event,"
            " before data: [DONE] (stream_truncated)",
        ),
        # A line-framed stream without a terminal line (not Ollama-shaped).
        (
            "ndjson",
            "application/x-ndjson",
            b'{"n": 1}\n{"n"',
            "streamwarden: the upstream ended the stream inside an unfinished line"
            " (stream_truncated)",
        ),
    ],
    ids=[
        "boundary-with-terminal",
        "generic-mid-event",
        "mid-event-with-terminal",
        "ndjson-mid-line",
    ],
)
def test_the_truncation_message_says_what_happened(
    dialect: str, content_type: str, upstream: bytes, expected: str
) -> None:
    message = truncation_message("/x", content_type, upstream, dialect)
    assert message == expected
    assert "none" not in message


def test_events_before_a_failure_are_forwarded_and_the_partial_one_is_dropped() -> None:
    relay = new_relay()
    out = relay.feed(chunk("a") + chunk("b") + b'data: {"partial', 0.1)
    assert out == chunk("a") + chunk("b")
    error = relay.upstream_failed(0.2)
    assert b"partial" not in error
    assert relay.meter.events_out == 2


def test_oversized_event_keeps_the_events_before_it_in_the_same_read() -> None:
    relay = new_relay()
    out = relay.feed(chunk("a") + b"data: " + b"x" * 2000 + b"\n\n" + chunk("b"), 0.1)
    assert out.startswith(chunk("a"))
    assert b"xxx" not in out
    assert b"event_too_large" in out
    assert relay.end_state == "limit_exceeded"


def test_keepalive_is_due_one_interval_after_the_last_write() -> None:
    relay = new_relay()
    assert relay.deadline == 1.0
    assert relay.poll(0.99) == b""
    assert relay.poll(1.0) == KEEPALIVE
    assert relay.deadline == 2.0
    relay.feed(chunk("a"), 1.5)
    assert relay.deadline == 2.5  # a written event restarts the interval
    assert relay.poll(2.5) == KEEPALIVE
    assert relay.meter.keepalives == 2


def test_silent_upstream_yields_one_keepalive_per_interval() -> None:
    relay = new_relay(Limits(1.0, 60.0, 1000.0, 1024))
    writes = []
    now = 0.0
    while now < 10.0:
        deadline = relay.deadline
        assert deadline is not None
        now = deadline
        out = relay.poll(now)
        if out:
            writes.append((now, out))
    assert [t for t, _ in writes] == pytest.approx([float(i) for i in range(1, 11)])
    assert all(out == KEEPALIVE for _, out in writes)


def test_keepalive_never_splits_an_event() -> None:
    relay = new_relay(Limits(1.0, 60.0, 1e6, 1024))
    written = b""
    event = chunk("héllo wörld")
    # The upstream sends one event a byte at a time, stalling between bytes
    # longer than the keep-alive interval.
    now = 0.0
    for i in range(len(event)):
        now += 1.5
        written += relay.poll(now)
        written += relay.feed(event[i : i + 1], now)
    assert relay.meter.keepalives > 10
    # Every write is a whole block: the client's view is keep-alives and
    # then the complete event, never a comment inside it.
    assert written == KEEPALIVE * relay.meter.keepalives + event
    assert SSEDecoder().feed(written)[0].data == SSEDecoder().feed(event)[0].data


def test_line_framed_streams_get_no_comment_keepalives() -> None:
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.0,
        path="/api/chat",
        content_type="application/x-ndjson",
        headers={},
    )
    assert relay.deadline == 5.0  # only the idle timeout runs
    assert relay.poll(4.0) == b""


def test_disabled_timers_leave_no_deadline() -> None:
    relay = new_relay(Limits(0, 0, 0, 1024))
    assert relay.deadline is None


def test_ttft_and_gaps_are_measured_at_delivery() -> None:
    gaps: list[float] = []
    relay = Relay(
        LIMITS,
        started_at=0.0,
        now=0.2,
        path="/v1/chat/completions",
        content_type="text/event-stream",
        headers={},
        gap_observer=gaps.append,
    )
    relay.feed(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n', 0.3)
    relay.feed(chunk("a"), 0.5)
    relay.feed(chunk("b"), 0.55)
    relay.feed(chunk("c"), 0.75)
    assert relay.meter.ttft == pytest.approx(0.5)  # role-only chunk is not content
    assert gaps == pytest.approx([0.05, 0.2])
    assert relay.meter.gap_max == pytest.approx(0.2)


def test_completed_stream_with_usage_delivers_what_was_generated() -> None:
    relay = new_relay()
    relay.feed(chunk("a") + chunk("b") + USAGE + DONE, 0.1)
    relay.upstream_eof(0.2)
    assert relay.meter.tokens_method == "usage"
    assert relay.meter.tokens_generated == 7
    assert relay.meter.tokens_delivered == 7
    assert relay.meter.tokens_zombie == 0


def test_tokens_arriving_after_the_client_left_are_zombies() -> None:
    relay = new_relay()
    relay.feed(chunk("a") + chunk("b"), 0.1)
    relay.client_gone(0.2)
    assert relay.feed(chunk("c") + chunk("d") + chunk("e"), 0.3) == b""
    meter = relay.meter
    assert relay.end_state == "client_cancelled"
    assert meter.tokens_method == "estimate"
    assert meter.tokens_delivered == 2
    assert meter.tokens_zombie == 3
    assert meter.tokens_generated == 5
    assert meter.events_out == 2
    assert meter.events_in == 5


def test_usage_is_split_between_delivered_and_zombie() -> None:
    relay = new_relay()
    relay.feed(chunk("a") + chunk("b"), 0.1)
    relay.client_gone(0.2)
    relay.feed(
        chunk("c") + chunk("d") + b'data: {"choices":[],"usage":{"completion_tokens":8}}\n\n', 0.3
    )
    assert relay.meter.tokens_generated == 8
    assert relay.meter.tokens_zombie == 4
    assert relay.meter.tokens_delivered == 4


def test_meter_counts_bytes_and_events_both_ways() -> None:
    relay = new_relay()
    data = b": ping\n\n" + chunk("a") + DONE
    out = relay.feed(data, 0.1) + relay.poll(1.1) + relay.upstream_eof(1.2)
    meter = relay.meter
    assert meter.bytes_in == len(data)
    assert meter.bytes_out == len(out) == len(data) + len(KEEPALIVE)
    assert meter.events_in == meter.events_out == 2
    record = meter.as_record()
    assert record["end_state"] == "completed"
    assert record["keepalives"] == 1
