"""``streamwarden probe --plot FILE.png``: send time against arrival time, per event.

On a clean path the events lie on a line parallel to the diagonal (each
arrives a constant path delay after it was sent); a hop that buffers shows
as flat steps (many events sent over a while, arriving at one moment), and
an idle cut as a line that stops. Without send times (the far end is not
``streamwarden mock-upstream``) the x axis is the event's number instead.

matplotlib is the ``plot`` extra (``pip install "streamwarden[plot]"``); it
is imported only here, with the Agg backend, so no display is needed.
"""

from __future__ import annotations

from pathlib import Path

from streamwarden.tools.probe.measure import Report

__all__ = ["PlotUnavailable", "plot"]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot(report: Report, path: str | Path, title: str) -> None:
    """Draw ``report``'s events into a PNG file at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable('--plot needs matplotlib: pip install "streamwarden[plot]"') from None

    figure = Figure(figsize=(7.0, 4.2), dpi=100, layout="constrained")
    axes = figure.subplots()
    stamped = [e for e in report.events if e.sent_wall is not None and e.delay is not None]
    if stamped:
        origin = min(e.sent_wall for e in stamped if e.sent_wall is not None)
        sent = [(e.sent_wall or 0.0) - origin for e in stamped]
        arrived = [s + (e.delay or 0.0) for s, e in zip(sent, stamped, strict=True)]
        least = min(e.delay or 0.0 for e in stamped)
        top = max([*sent, *arrived, 0.001])
        axes.plot([0, top], [least, top + least], color="0.75", linewidth=1, label="no buffering")
        axes.plot(sent, arrived, "o", markersize=3.5, color="tab:blue", label="event")
        if report.keepalive_times:
            # Keep-alives have no send time: a tick at the right edge, at their arrival.
            ticks = [report.started_wall + at - origin for at in report.keepalive_times]
            axes.plot(
                [top] * len(ticks), ticks, "_", markersize=12, color="tab:green", label="keep-alive"
            )
        axes.set_xlabel("sent (s, at the far end)")
        axes.set_ylabel("arrived (s, at the probe)")
    else:
        numbers = [e.index for e in report.events]
        axes.plot(numbers, [e.at for e in report.events], "o", markersize=3.5, label="event")
        if report.keepalive_times:
            right = max(numbers, default=1)
            axes.plot(
                [right] * len(report.keepalive_times),
                report.keepalive_times,
                "_",
                markersize=12,
                color="tab:green",
                label="keep-alive",
            )
        axes.set_xlabel("event number (the far end does not stamp send times)")
        axes.set_ylabel("arrived (s after the request)")
    found = [v.symptom.value for v in report.verdicts if v.fails]
    axes.set_title(f"{title}\n{', '.join(found) if found else 'clean'}", fontsize=10)
    axes.grid(True, linewidth=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.savefig(Path(path), format="png")
