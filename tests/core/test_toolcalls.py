"""Tool calls through the relay, dialect by dialect: whole, cut, closed broken, too large.

Bytes in, bytes out, as the faces drive the relay. A whole tool-call stream
passes byte for byte with its calls recorded ``complete``; the rest (a cut
inside a call, a close with arguments that are not JSON, more arguments than
``max_tool_arguments_bytes``) end with the dialect's error event naming the
call, and what is held stays bounded whatever the upstream sends.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from streamwarden.core.filters import FilterRule, compile_filters
from streamwarden.core.meter import EndState, StreamRecord
from streamwarden.core.relay import Relay
from streamwarden.core.toolcalls import CALL_OVERHEAD, LABEL_CHARS, ToolCalls, close_step, label
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.tools.mock.formats import WIRE_FORMATS, Answer
from streamwarden.tools.mock.tokens import mock_tokens
from tool_streams import BY_NAME, LIMITS, STREAMS, ToolStream, error_of, names_the_call

CHAT = BY_NAME["openai-chat"]


def chat(*chunks: dict[str, Any], done: bool = True) -> bytes:
    """An OpenAI chat stream of ``choices`` chunks."""
    out = b"".join(f"data: {json.dumps({'choices': c['choices']})}\n\n".encode() for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def delta(choice: int, calls: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": choice, "delta": {"tool_calls": calls}, "finish_reason": finish}]}


def finish(choice: int, reason: str = "tool_calls") -> dict[str, Any]:
    return {"choices": [{"index": choice, "delta": {}, "finish_reason": reason}]}


def opened(index: int, call_id: str, arguments: str = "") -> dict[str, Any]:
    function = {"name": "lookup", "arguments": arguments}
    return {"index": index, "id": call_id, "type": "function", "function": function}


def args(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def run(stream: ToolStream, data: bytes, relay: Relay | None = None) -> tuple[Relay, bytes]:
    relay = relay or stream.relay()
    return relay, relay.feed(data, 1.0) + relay.upstream_eof(2.0)


def last_error(stream: ToolStream, out: bytes) -> tuple[str, str]:
    return error_of(stream, stream.decode(out)[-1])


# -- whole streams -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
def test_a_whole_tool_call_passes_byte_for_byte_and_is_recorded_complete(
    stream: ToolStream,
) -> None:
    data = b"".join(f.data for f in stream.frames(8))
    relay, out = run(stream, data)
    assert out == data and relay.end_state is EndState.COMPLETED
    assert relay.meter.error_code is None
    (call,) = relay.meter.as_record()["tool_calls"]
    assert call["end_state"] == "complete" and call["name"] == "lookup"
    assert call["id"] == stream.call_id() and call["arguments_bytes"] > 0


@pytest.mark.parametrize("wire", sorted(WIRE_FORMATS))
def test_a_stream_without_tool_calls_follows_none(wire: str) -> None:
    fmt = WIRE_FORMATS[wire]
    answer = Answer("r", "m", tuple(mock_tokens(6)), 3, 0)
    data = b"".join(f.data for f in fmt.frames(answer))
    headers = {k.lower(): v for k, v in fmt.stream_headers().items()}
    relay = Relay(
        LIMITS,
        started_at=0,
        now=0,
        path="/x",
        content_type=headers["content-type"],
        headers=headers,
    )
    assert relay.feed(data, 1.0) + relay.upstream_eof(2.0) == data
    # No tracker at all: the text stream pays nothing for tool calls.
    assert relay.meter.tool_calls is None and relay.meter.as_record()["tool_calls"] is None


# -- OpenAI chat: interleaved calls, choices, finish reasons ----------------------------


def test_interleaved_calls_of_two_choices_close_with_their_own_choice() -> None:
    data = chat(
        delta(0, [opened(0, "call_a"), opened(1, "call_b")]),
        delta(1, [opened(0, "call_c", '{"q":')]),
        delta(0, [args(1, '{"x": 1}'), args(0, '{"y"')]),
        delta(0, [args(0, ": 2}")]),
        finish(0),  # choice 0's two calls are whole; choice 1's is still open
        done=False,
    )
    relay, out = run(CHAT, data)
    assert out.startswith(data)
    code, message = last_error(CHAT, out)
    assert code == "tool_call_truncated" and "call_c (lookup)" in message
    assert "with 5 bytes of its arguments received" in message
    calls = {c["id"]: c["end_state"] for c in relay.meter.as_record()["tool_calls"]}
    assert calls == {"call_a": "complete", "call_b": "complete", "call_c": "truncated"}


def test_a_call_cut_by_the_length_limit_is_closed_broken() -> None:
    data = chat(delta(0, [opened(0, "call_a", '{"q": "half')]), finish(0, "length"))
    relay, out = run(CHAT, data)
    code, message = last_error(CHAT, out)
    assert code == "tool_call_invalid" and "call_a (lookup)" in message
    # The close and what follows it ([DONE]) never reach the client.
    assert out.startswith(chat(delta(0, [opened(0, "call_a", '{"q": "half')]), done=False))
    assert b"[DONE]" not in out and b'"finish_reason": "length"' not in out
    assert relay.end_state is EndState.UPSTREAM_ERROR
    assert relay.meter.error_code == "tool_call_invalid"


def test_done_closes_the_calls_a_server_never_finished() -> None:
    whole = chat(delta(0, [opened(0, "call_a", '{"q": 1}')]))
    relay, out = run(CHAT, whole)
    assert out == whole and relay.end_state is EndState.COMPLETED
    broken = chat(delta(0, [opened(0, "call_a", '{"q": 1')]))
    relay, out = run(CHAT, broken)
    assert last_error(CHAT, out)[0] == "tool_call_invalid" and b"[DONE]" not in out


def test_a_server_that_numbers_every_call_0_gets_each_call_checked_on_its_own() -> None:
    data = chat(
        delta(0, [opened(0, "call_a", '{"a": 1}')]),
        delta(0, [opened(0, "call_b", '{"b": 2}')]),
        finish(0),
    )
    relay, out = run(CHAT, data)
    assert out == data and relay.end_state is EndState.COMPLETED
    calls = relay.meter.as_record()["tool_calls"]
    assert [(c["id"], c["end_state"]) for c in calls] == [
        ("call_a", "complete"),
        ("call_b", "complete"),
    ]
    broken = chat(delta(0, [opened(0, "call_a", '{"a": ')]), delta(0, [opened(0, "call_b")]))
    relay, out = run(CHAT, broken)
    code, message = last_error(CHAT, out)
    assert code == "tool_call_invalid" and "call_a" in message


def test_empty_arguments_are_no_arguments_and_non_objects_are_broken() -> None:
    relay, out = run(CHAT, chat(delta(0, [opened(0, "call_a")]), finish(0)))
    assert relay.end_state is EndState.COMPLETED
    for arguments in ('"a string"', "[1, 2]", "NaN", '{"a": NaN}', "{} {}"):
        relay, out = run(CHAT, chat(delta(0, [opened(0, "call_a", arguments)]), finish(0)))
        assert last_error(CHAT, out)[0] == "tool_call_invalid", arguments


# -- the other dialects' own cases -------------------------------------------------------


def anthropic_events(*events: dict[str, Any]) -> bytes:
    return (
        b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
        + b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


def test_anthropic_a_tool_without_parameters_and_a_text_block_beside_it() -> None:
    stream = BY_NAME["anthropic"]
    tool = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}
    data = anthropic_events(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": tool},
        {"type": "content_block_stop", "index": 1},
    )
    relay, out = run(stream, data)
    assert out == data and relay.end_state is EndState.COMPLETED
    (call,) = relay.meter.as_record()["tool_calls"]
    assert call == {
        "id": "toolu_1",
        "name": "lookup",
        "end_state": "complete",
        "arguments_bytes": 0,
    }


def test_the_vercel_sdks_own_tool_input_error_passes_and_is_recorded() -> None:
    stream = BY_NAME["vercel-ui"]
    parts = [
        {"type": "tool-input-start", "toolCallId": "c1", "toolName": "lookup"},
        {"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": '{"q": '},
        {
            "type": "tool-input-error",
            "toolCallId": "c1",
            "toolName": "lookup",
            "input": '{"q": ',
            "errorText": "Invalid input",
        },
        {"type": "finish"},
    ]
    data = b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in parts) + b"data: [DONE]\n\n"
    relay, out = run(stream, data)
    assert out == data and relay.end_state is EndState.COMPLETED  # the client was told
    assert relay.meter.as_record()["tool_calls"][0]["end_state"] == "invalid"


def test_gemini_a_whole_call_whose_args_are_not_an_object_is_broken() -> None:
    stream = BY_NAME["gemini"]

    def chunk(call: dict[str, Any]) -> bytes:
        candidate = {"content": {"parts": [{"functionCall": call}]}, "finishReason": "STOP"}
        return f"data: {json.dumps({'candidates': [candidate]})}\r\n\r\n".encode()

    relay, out = run(stream, chunk({"name": "ping"}))  # no args: no parameters
    assert relay.end_state is EndState.COMPLETED
    relay, out = run(stream, chunk({"name": "lookup", "args": '{"query": "Str'}))
    code, message = last_error(stream, out)
    assert (
        code == "tool_call_invalid" and "(lookup)" in message and out.startswith(b'data: {"error"')
    )


def test_a_responses_custom_tool_input_is_free_text() -> None:
    stream = BY_NAME["openai-responses"]
    item = {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1", "name": "grep"}
    events = [
        ("response.output_item.added", {"output_index": 0, "item": {**item, "input": ""}}),
        ("response.custom_tool_call_input.delta", {"output_index": 0, "delta": "not {json"}),
        ("response.custom_tool_call_input.done", {"output_index": 0, "input": "not {json"}),
        ("response.output_item.done", {"output_index": 0, "item": {**item, "input": "not {json"}}),
        ("response.completed", {"response": {"usage": {"output_tokens": 3}}}),
    ]
    data = b"".join(
        f"event: {name}\ndata: {json.dumps({'type': name, **fields})}\n\n".encode()
        for name, fields in events
    )
    relay, out = run(stream, data)
    assert out == data and relay.end_state is EndState.COMPLETED
    assert relay.meter.as_record()["tool_calls"][0] == {
        "id": "call_1",
        "name": "grep",
        "end_state": "complete",
        "arguments_bytes": 9,
    }


# -- every way a stream ends, inside a call ----------------------------------------------

OPEN_CALL = chat(delta(0, [opened(0, "call_a", '{"q": "par')]), done=False)


@pytest.mark.parametrize(
    ("end", "state"),
    [
        (lambda r: r.upstream_failed(2.0), EndState.UPSTREAM_ERROR),
        (lambda r: r.poll(60.0), EndState.UPSTREAM_TIMEOUT),
        (lambda r: r.shutdown(2.0), EndState.SHUTDOWN),
        (lambda r: r.feed(b"data: " + b"x" * 2048, 2.0), EndState.LIMIT_EXCEEDED),
    ],
    ids=["reset", "silence", "drain", "event-too-large"],
)
def test_any_end_inside_a_call_says_tool_call_truncated_and_keeps_its_end_state(
    end: Any, state: EndState
) -> None:
    relay = CHAT.relay(replace(LIMITS, max_event_bytes=1024))
    out = relay.feed(OPEN_CALL, 1.0) + end(relay)
    code, message = last_error(CHAT, out)
    assert code == "tool_call_truncated" and "call_a (lookup)" in message
    assert relay.end_state is state and relay.meter.error_code == "tool_call_truncated"


def test_a_filter_block_inside_a_call_keeps_content_blocked() -> None:
    filters = compile_filters((FilterRule("literal", "secret", "block", "s"),), True)
    data = chat(delta(0, [opened(0, "call_a", '{"q": "a secret')]), done=False)
    relay, out = run(CHAT, data, CHAT.relay(filters=filters))
    assert last_error(CHAT, out)[0] == "content_blocked"
    assert relay.end_state is EndState.BLOCKED


def test_a_client_gone_inside_a_call_writes_nothing_and_counts_it_truncated() -> None:
    relay = CHAT.relay()
    relay.feed(OPEN_CALL, 1.0)
    relay.client_gone(1.5)
    assert relay.end_state is EndState.CLIENT_CANCELLED
    metrics = StreamMetrics()
    metrics.stream_finished(
        StreamRecord("1", "/", "POST", "/v1/x", 200, "openai-chat", relay.meter)
    )
    page = metrics.render().decode()
    assert 'streamwarden_tool_calls_total{dialect="openai-chat",end_state="truncated"} 1.0' in page


def test_the_calls_open_are_shown_live() -> None:
    relay = CHAT.relay()
    relay.feed(OPEN_CALL, 1.0)
    assert relay.calls.open_calls() == [{"id": "call_a", "name": "lookup", "arguments_bytes": 10}]


# -- bounds --------------------------------------------------------------------------------


def test_arguments_over_the_limit_end_the_stream_in_place_of_the_event_that_went_over() -> None:
    limit = 4096
    relay = CHAT.relay(replace(LIMITS, max_tool_arguments_bytes=limit))
    first = chat(delta(0, [opened(0, "call_a", '{"q": "')]), done=False)
    out = relay.feed(first, 1.0)
    piece = chat(delta(0, [args(0, "x" * 1000)]), done=False)
    for _ in range(10):
        out += relay.feed(piece, 1.0)
        if relay.done:
            break
    code, message = last_error(CHAT, out)
    assert code == "tool_call_too_large" and "4096 bytes" in message and "call_a" in message
    assert relay.end_state is EndState.LIMIT_EXCEEDED
    # Three pieces fit beside the call's own 256 bytes; the fourth went over and was not sent.
    assert out.count(b'"arguments": "xxx') == 3


def test_a_flood_of_calls_is_bounded_whatever_their_indices() -> None:
    limit = 64 * 1024
    relay = CHAT.relay(replace(LIMITS, max_tool_arguments_bytes=limit))
    out = b""
    for n in range(1000):  # an upstream opening call after call, never closing one
        index = 2**62 + n * 2**40  # hostile indices: keys, never list positions
        out += relay.feed(chat(delta(0, [opened(index, f"call_{n}")]), done=False), 1.0)
        if relay.done:
            break
    # The one that went over: each call costs its bookkeeping, its key, id and name.
    assert relay.done and limit // (CALL_OVERHEAD + 32) <= n < limit // CALL_OVERHEAD
    assert last_error(CHAT, out)[0] == "tool_call_too_large"
    tools = relay.meter.tool_calls
    assert tools is not None and len(tools.open_calls) == n and len(tools.listed) == 16


def test_a_whole_argument_over_the_limit_is_too_large() -> None:
    tools = ToolCalls(1000)
    broken = tools.follow([close_step("k", '{"a": "' + "x" * 1000 + '"}', whole=True)])
    assert broken is not None and broken.end_state == "too_large"


def test_hostile_ids_names_and_indices_are_labels_or_nothing() -> None:
    hostile = [
        {"index": [1], "id": {"x": 1}, "function": {"name": ["lookup"], "arguments": "{}"}},
        {"index": True, "id": "c\n\u0007" + "z" * 500, "function": {"name": "\ud800lookup"}},
    ]
    relay, _ = run(CHAT, chat(delta(0, hostile), finish(0)))
    assert relay.end_state is EndState.COMPLETED
    calls = relay.meter.as_record()["tool_calls"]
    assert [c["id"] for c in calls] == ["", "c" + "z" * (LABEL_CHARS - 3)]
    assert calls[1]["name"] == "?lookup"
    json.dumps(calls).encode()  # writable, in a log line as anywhere
    assert label(42) == "" and label("é" * 100) == "é" * LABEL_CHARS


@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
def test_a_truncated_call_is_named_in_every_dialect(stream: ToolStream) -> None:
    frames = stream.frames(8)
    # Half the fragments, whole events: cut between two of the call's own events.
    data = b"".join(f.data for f in frames[: len(frames) // 2])
    if stream.whole:
        data = frames[0].data[: len(frames[0].data) // 2]  # inside its one event
    _, out = run(stream, data)
    code, message = last_error(stream, out)
    assert code == "tool_call_truncated" and names_the_call(stream, message), message
