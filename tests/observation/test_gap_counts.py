"""The gaps between content events are counted into the buckets Prometheus reads.

``GapCounts`` (compiled with the meter) does the per-event count the metrics'
histogram used to do through ``bisect``; it must put every gap where
``bisect_left`` did, the exposition must read it, and the meter must call it.
"""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from streamwarden.core.meter import GapCounts, StreamMeter
from streamwarden.observation.metrics import GAP_BUCKETS, StreamMetrics

_BOUNDS = st.lists(st.floats(0, 100), min_size=1, max_size=20, unique=True).map(sorted)


@given(_BOUNDS, st.lists(st.floats(0, 120), max_size=50))
def test_each_gap_lands_where_bisect_left_puts_it(bounds: list[float], gaps: list[float]) -> None:
    counts = GapCounts(tuple(bounds))
    expected = [0] * (len(bounds) + 1)
    for gap in gaps:
        counts.observe(gap)
        expected[bisect_left(bounds, gap)] += 1
    assert counts.counts == expected
    assert counts.total == sum(gaps)


def test_the_meter_counts_its_gaps_into_the_exposition() -> None:
    metrics = StreamMetrics()
    meter = StreamMeter(0.0, metrics.inter_token.counts)
    for at in (1.0, 1.004, 1.044, 3.0):  # gaps of 4 ms, 40 ms and 1.956 s
        meter.content("tok", at, delivered=True)
    text = generate_latest(metrics.registry).decode()
    assert 'streamwarden_inter_token_seconds_bucket{le="0.005"} 1.0' in text
    assert 'streamwarden_inter_token_seconds_bucket{le="0.05"} 2.0' in text
    assert 'streamwarden_inter_token_seconds_bucket{le="2.5"} 3.0' in text
    assert "streamwarden_inter_token_seconds_count 3.0" in text
    assert tuple(metrics.inter_token.counts.bounds) == GAP_BUCKETS
