"""A face's own metrics as numbers: its Prometheus page read by sample name."""

from __future__ import annotations

from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.sidecar import Sidecar


def samples(text: str) -> dict[str, float]:
    """A Prometheus text page's samples, keyed by series: the name and its labels."""
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def metric(face: Sidecar | StreamWardenMiddleware, name: str) -> float:
    """A sample of the face's own metrics (0 when it has not been written yet)."""
    return samples(face.metrics.render().decode()).get(name, 0.0)
