"""Every cut of every dialect's tool-call stream: a partial call never passes as complete.

For each dialect the mock's tool-call stream is cut after every byte (an
upstream that ends cleanly there), then at random offsets, chunkings and
kinds of cut (a clean end, a reset, a silent upstream), with and without
output filters. At every cut the client gets the whole events before it,
unchanged, and one error event: ``tool_call_truncated``, naming the call,
when the cut falls inside the call, the cut's own code otherwise; only the
whole stream ends ``completed``. A call closed after any prefix of its
arguments gets ``tool_call_invalid`` in place of its close.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamwarden.core.filters import FilterRule, compile_filters
from streamwarden.core.meter import EndState
from streamwarden.core.relay import Relay
from tool_streams import STREAMS, Layout, ToolStream, error_of, inside_call, layout, names_the_call

TOKENS = 4
FILTERS = compile_filters((FilterRule("literal", "no such text", "redact", "x"),), True)
# What each kind of cut is without a call open: its code and end state.
CUTS = {
    "eof": ("stream_truncated", EndState.UPSTREAM_TRUNCATED),
    "reset": ("upstream_error", EndState.UPSTREAM_ERROR),
    "silence": ("upstream_timeout", EndState.UPSTREAM_TIMEOUT),
}


def _cut(relay: Relay, kind: str, now: float) -> bytes:
    if kind == "eof":
        return relay.upstream_eof(now)
    if kind == "reset":
        return relay.upstream_failed(now)
    return relay.poll(now + 60.0)  # past upstream_idle_timeout


def _check(
    stream: ToolStream, shape: Layout, cut: int, relay: Relay, out: bytes, kind: str
) -> None:
    data = shape.data
    sent = stream.decode(out)
    if cut == len(data) or shape.whole_frames(cut) > shape.terminal:
        assert relay.end_state is EndState.COMPLETED, (stream.name, cut)
        assert out == data[: len(out)] and stream.decode(data[:cut]) == sent
        return
    expected_code, expected_state = CUTS[kind]
    assert relay.end_state is expected_state, (stream.name, cut, relay.end_state)
    # The whole events before the cut, as they came, then one error event.
    assert sent[:-1] == stream.decode(data[:cut]), (stream.name, cut)
    code, message = error_of(stream, sent[-1])
    if inside_call(stream, shape, cut):
        assert code == "tool_call_truncated", (stream.name, cut, message)
        # A call cut inside its first event is named once its bytes so far spell the name.
        spelled = b'"name": "lookup"' in data[shape.starts[shape.opened] : cut]
        assert names_the_call(stream, message) or (stream.wire == "gemini" and not spelled)
    else:
        assert code == expected_code, (stream.name, cut, message)


@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
def test_a_cut_after_any_byte_never_passes_a_partial_call(stream: ToolStream) -> None:
    shape = layout(stream, stream.frames(TOKENS))
    inside = 0
    for cut in range(len(shape.data) + 1):
        relay = stream.relay()
        out = relay.feed(shape.data[:cut], 1.0) + relay.upstream_eof(2.0)
        _check(stream, shape, cut, relay, out, "eof")
        inside += inside_call(stream, shape, cut)
    assert inside > 0  # the cuts did fall inside the call


@settings(max_examples=150, deadline=None)
@given(
    stream=st.sampled_from(STREAMS),
    tokens=st.integers(1, 6),
    data=st.data(),
    kind=st.sampled_from(sorted(CUTS)),
    filtered=st.booleans(),
)
def test_any_chunking_and_any_cut_name_a_cut_call(
    stream: ToolStream, tokens: int, data: st.DataObject, kind: str, filtered: bool
) -> None:
    shape = layout(stream, stream.frames(tokens))
    cut = data.draw(st.integers(0, len(shape.data)), label="cut")
    splits = sorted(data.draw(st.lists(st.integers(0, cut), max_size=8), label="splits"))
    relay = stream.relay(filters=FILTERS if filtered else None)
    out = b""
    start = 0
    for at in [*splits, cut]:
        out += relay.feed(shape.data[start:at], 1.0)
        start = at
    out += _cut(relay, kind, 2.0)
    _check(stream, shape, cut, relay, out, kind)


@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
def test_a_call_closed_after_any_prefix_of_its_arguments_is_invalid(stream: ToolStream) -> None:
    tokens = 6
    for kept in range(1, tokens):
        frames = stream.frames(tokens, broken_after=kept)
        shape = layout(stream, frames)
        for chunking in (len(shape.data), 7):  # whole, and in small pieces
            relay = stream.relay()
            out = b""
            for start in range(0, len(shape.data), chunking):
                out += relay.feed(shape.data[start : start + chunking], 1.0)
            out += relay.upstream_eof(2.0)
            sent = stream.decode(out)
            # Every event before the close, then the error in its place: nothing after.
            before = stream.decode(shape.data[: shape.starts[shape.closed]])
            assert sent[:-1] == before, (stream.name, kept)
            code, message = error_of(stream, sent[-1])
            assert code == "tool_call_invalid" and names_the_call(stream, message), message
            assert relay.end_state is EndState.UPSTREAM_ERROR
