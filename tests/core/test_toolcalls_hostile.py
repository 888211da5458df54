"""Tool calls against a hostile or odd upstream: what leaves the tracker, what it holds.

Arguments never leave the tracker (an ``id`` inside them is no call's id);
what an upstream controls (its call keys, ids, names, the number of its
fragments) counts against ``max_tool_arguments_bytes``; a close is judged
on the whole input it carries.
"""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace
from typing import Any

from streamwarden.core.meter import EndState
from streamwarden.core.toolcalls import LISTED, ToolCalls, arguments_step, close_step, open_step
from tool_streams import BY_NAME, LIMITS, error_of

GEMINI = BY_NAME["gemini"]


def test_a_gemini_cut_names_the_call_by_its_own_keys_never_by_its_arguments() -> None:
    first = {"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]}}]}
    head = f"data: {json.dumps(first)}\n\n".encode()
    cuts = {
        # An id inside the args, and the name after them: only the call's own keys.
        b'{"functionCall":{"args":{"account":{"id":"ACCT-SECRET-4111","name":"N-SECRET"}},'
        b'"name":"transfer","id":"fc_1","x":"': ("fc_1", "transfer"),
        # Cut inside the args before the call's own id came: no id at all.
        b'{"functionCall":{"name":"transfer",'
        b'"args":{"account":{"id":"ACCT-SECRET-4111","pin":"12': ("", "transfer"),
        b'{"functionCall":{"args":["id","ACCT-SECRET-4111",{"name":"N-SECRET"': ("", ""),
    }
    for call, (call_id, name) in cuts.items():
        relay = GEMINI.relay()
        cut = b'data: {"candidates":[{"content":{"role":"model","parts":[' + call
        out = relay.feed(head + cut, 1.0) + relay.upstream_failed(2.0)
        record = json.dumps(relay.meter.as_record())
        assert b"SECRET" not in out and "SECRET" not in record, call
        code, message = error_of(GEMINI, GEMINI.decode(out)[-1])
        assert code == "tool_call_truncated" and f"({name or 'unnamed'})" in message, message
        (listed,) = relay.meter.as_record()["tool_calls"]
        assert (listed["id"], listed["name"]) == (call_id, name)


# -- what an upstream controls is held against the limit -----------------------------------


def ui_part(part: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(part)}\n\n".encode()


def responses_event(kind: str, body: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n".encode()


def test_call_keys_as_long_as_an_upstream_likes_count_against_the_limit() -> None:
    limit = 256 * 1024
    long_id = "k" * (64 * 1024)
    opens = {
        # A toolCallId is the call's key: 64 KiB each.
        "vercel-ui": lambda n: ui_part(
            {"type": "tool-input-start", "toolCallId": f"{n}{long_id}", "toolName": "f"}
        ),
        # Without an output_index the item's id is.
        "openai-responses": lambda n: responses_event(
            "response.function_call_arguments.delta", {"item_id": f"{n}{long_id}", "delta": "{"}
        ),
    }
    for name, event in opens.items():
        stream = BY_NAME[name]
        relay = stream.relay(replace(LIMITS, max_tool_arguments_bytes=limit))
        out = b""
        for n in range(64):  # a handful fit; 64 would hold 4 MiB against 256 KiB
            out += relay.feed(event(n), 1.0)
            if relay.done:
                break
        assert relay.done and n < limit // len(long_id), name
        assert error_of(stream, stream.decode(out)[-1])[0] == "tool_call_too_large"


def test_a_call_of_many_tiny_fragments_holds_about_their_bytes() -> None:
    limit = 64 * 1024
    tools = ToolCalls(limit)
    tools.follow([open_step("k", "call_1", "lookup")])
    fragments = 60_000  # one byte each: a string object and a list slot each, unjoined
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(fragments):
            assert tools.follow([arguments_step("k", "a")]) is None
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * fragments, held  # unjoined: about 60 bytes a fragment
    (call,) = tools.open_calls
    assert call.size == fragments
    assert tools.follow([close_step("k", verdict=None)]) is not None  # "aaa...": not JSON


# -- a close is judged on the input it carries ---------------------------------------------


def test_a_vercel_close_is_judged_on_its_whole_input_not_on_the_deltas() -> None:
    ui, data_stream = BY_NAME["vercel-ui"], BY_NAME["vercel-data"]

    def ui_call(delta: str, whole: Any) -> bytes:
        parts = [
            {"type": "tool-input-start", "toolCallId": "call_1", "toolName": "lookup"},
            {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": delta},
            {"type": "tool-input-available", "toolCallId": "call_1", "toolName": "lookup"}
            | ({} if whole is None else {"input": whole}),
            {"type": "finish"},
        ]
        return b"".join(map(ui_part, parts)) + b"data: [DONE]\n\n"

    def data_call(delta: str, whole: Any) -> bytes:
        lines = [
            ("b", {"toolCallId": "call_1", "toolName": "lookup"}),
            ("c", {"toolCallId": "call_1", "argsTextDelta": delta}),
            (
                "9",
                {"toolCallId": "call_1", "toolName": "lookup"}
                | ({} if whole is None else {"args": whole}),
            ),
            ("d", {"finishReason": "tool-calls"}),
        ]
        return b"".join(f"{kind}:{json.dumps(value)}\n".encode() for kind, value in lines)

    for stream, render in ((ui, ui_call), (data_stream, data_call)):
        # Deltas not strict JSON that the SDK repaired into an object: whole.
        whole = render("{'q': 'x'}", {"q": "x"})
        relay = stream.relay()
        out = relay.feed(whole, 1.0) + relay.upstream_eof(2.0)
        assert out == whole and relay.end_state is EndState.COMPLETED, stream.name
        # Deltas that are JSON, an input that is not an object: what the client runs is broken.
        for broken in ('"a string"', [1, 2]):
            relay = stream.relay()
            out = relay.feed(render('{"q": "x"}', broken), 1.0) + relay.upstream_eof(2.0)
            assert error_of(stream, stream.decode(out)[-1])[0] == "tool_call_invalid", stream.name
        # No whole input: the deltas decide.
        relay = stream.relay()
        out = relay.feed(render('{"q": ', None), 1.0) + relay.upstream_eof(2.0)
        assert error_of(stream, stream.decode(out)[-1])[0] == "tool_call_invalid", stream.name


def test_the_calls_open_are_listed_up_to_16_and_counted() -> None:
    relay = BY_NAME["vercel-ui"].relay()
    opened = 100
    relay.feed(
        b"".join(
            ui_part({"type": "tool-input-start", "toolCallId": f"c{n}", "toolName": "f"})
            for n in range(opened)
        ),
        1.0,
    )
    listed = relay.calls.open_calls()
    assert [c["id"] for c in listed] == [f"c{n}" for n in range(LISTED)]
    assert relay.calls.open_count == opened


def test_a_gateway_repeating_the_calls_id_on_every_chunk_keeps_one_call() -> None:
    chat = BY_NAME["openai-chat"]

    def chunk(arguments: str, finish: str | None = None) -> bytes:
        call = {"index": 0, "id": "call_a", "type": "function"}
        call["function"] = {"name": "lookup", "arguments": arguments}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish}
        return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

    # Split anywhere but at the whole: each piece alone is not JSON.
    data = b"".join(chunk(piece) for piece in ('{"q', '": "a', ' b"', "}")) + b"data: [DONE]\n\n"
    relay = chat.relay()
    out = relay.feed(data, 1.0) + relay.upstream_eof(2.0)
    assert out == data and relay.end_state is EndState.COMPLETED
    (call,) = relay.meter.as_record()["tool_calls"]
    assert (call["id"], call["end_state"], call["arguments_bytes"]) == ("call_a", "complete", 12)
