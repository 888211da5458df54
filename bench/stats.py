"""Percentiles and the comparisons the report makes between paths."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PERCENTILES", "added", "percentiles", "ratio"]

PERCENTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "p999": 0.999}


def percentiles(ordered: Sequence[int | float], scale: float = 1e-6) -> dict[str, float | None]:
    """p50/p90/p99/p99.9/max of already sorted samples, times ``scale`` (ns to ms by default).

    Nearest-rank on the sorted samples: no interpolation, so a p99 is a
    latency some event really had.
    """
    n = len(ordered)
    out: dict[str, float | None] = {}
    for name, q in PERCENTILES.items():
        out[name] = round(ordered[min(n - 1, int(q * n))] * scale, 4) if n else None
    out["max"] = round(ordered[-1] * scale, 4) if n else None
    out["n"] = n
    return out


def added(path: dict[str, float | None], base: dict[str, float | None]) -> dict[str, float | None]:
    """``path - base`` percentile by percentile (the latency a hop adds)."""
    out: dict[str, float | None] = {}
    for key in ("p50", "p90", "p99", "p999"):
        a, b = path.get(key), base.get(key)
        out[key] = None if a is None or b is None else round(a - b, 4)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 2)
