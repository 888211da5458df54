"""Speed of the sans-I/O core on a recorded-style 2,000-event OpenAI stream.

Run: ``pytest bench/test_core_speed.py --benchmark-only`` (numbers in the README).
The stream arrives in 1,400-byte reads, about what a TCP socket hands over.
"""

from __future__ import annotations

import pytest

from bench.fixtures import long_openai_stream
from streamwarden.core.relay import Limits, Relay
from streamwarden.core.sse import SSEDecoder, SSEFramer

STREAM = long_openai_stream(2000)
READS = [STREAM[i : i + 1400] for i in range(0, len(STREAM), 1400)]
EVENTS = len(SSEDecoder().feed(STREAM))


def decode() -> int:
    decoder = SSEDecoder()
    return sum(len(decoder.feed(read)) for read in READS)


def frame() -> int:
    framer = SSEFramer()
    return sum(len(framer.feed(read)) for read in READS)


def relay() -> int:
    r = Relay(
        Limits(15.0, 60.0, 1800.0, 8 << 20),
        started_at=0.0,
        now=0.0,
        path="/v1/chat/completions",
        content_type="text/event-stream",
        headers={},
    )
    written = sum(len(r.feed(read, 1.0)) for read in READS)
    r.upstream_eof(2.0)
    return written


@pytest.mark.parametrize("job", [decode, frame, relay], ids=["decode", "frame", "relay"])
def test_core_throughput(benchmark, job) -> None:  # type: ignore[no-untyped-def]
    result = benchmark(job)
    assert result > 0
    if not benchmark.disabled:  # CI runs this as a smoke test only
        benchmark.extra_info["events_per_second"] = round(EVENTS / benchmark.stats.stats.mean)
