"""Per-event cost of the relay alone, on a text stream and on a tool-call stream.

Run with each build's Python for a before/after of the core (numbers in the
README's Speed section)::

    python -m bench.relay_ab            # best of 7 rounds, in µs per event

The text stream is the 2,000-event OpenAI stream of ``bench/test_core_speed.py``;
the tool-call stream is the recorded ``openai_chat_tool_call.sse`` repeated
(its ``[DONE]`` dropped between copies) to about as many events. Both arrive in
1,400-byte reads.
"""

from __future__ import annotations

import json
import time

from bench.fixtures import FIXTURES, long_openai_stream

try:  # the layout since issue 26; an older build has the flat names only
    from streamwarden.core.relay import Limits, Relay
except ImportError:  # pragma: no cover - a build from before the move
    from streamwarden.relay import Limits, Relay  # type: ignore[no-redef]


def _tool_stream() -> bytes:
    one = (FIXTURES / "streams" / "openai_chat_tool_call.sse").read_bytes()
    body = one.replace(b"data: [DONE]\n\n", b"")
    return body * 60 + b"data: [DONE]\n\n"


def per_event(stream: bytes, rounds: int) -> float:
    reads = [stream[i : i + 1400] for i in range(0, len(stream), 1400)]
    events = stream.count(b"\n\n")
    best = float("inf")
    for _ in range(rounds):
        relay = Relay(
            Limits(15.0, 60.0, 1800.0, 8 << 20),
            started_at=0.0,
            now=0.0,
            path="/v1/chat/completions",
            content_type="text/event-stream",
            headers={},
        )
        began = time.perf_counter()
        for read in reads:
            relay.feed(read, 1.0)
        relay.upstream_eof(2.0)
        best = min(best, time.perf_counter() - began)
    return best / events * 1e6


def main() -> None:
    from streamwarden._native import native_summary

    result = {
        "build": native_summary(),
        "text_us_per_event": round(per_event(long_openai_stream(2000), 7), 3),
        "tool_call_us_per_event": round(per_event(_tool_stream(), 7), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
