"""The scale curve: CPU per event and memory per idle stream, 100 to 10,000 streams, one run.

::

    python -m bench.scale                      # about 8 minutes on 2 cores
    python -m bench.scale --counts 100,1000 --rounds 1

The sidecar and nginx side by side, in interleaved rounds as everywhere
in the harness. CPU: each count at 20 events/s a stream, but never more
than ``--max-rate`` events/s in all (20,000: past it the harness's own
upstream and client would take the machine, bench/README.md), so from
1,000 streams on the streams get fewer events each. Memory: scenario (d)
at each count, a fresh process per count (10,000 is capped by the
descriptor limit). Writes ``bench/results/scale-<stamp>.json`` and
``bench/results/scale.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

from bench.paths import REPO
from bench.scenarios import FULL, Bench, compare

OUT = REPO / "bench" / "results"


def measure(counts: list[int], paths: list[str], rounds: int, max_rate: float) -> dict[str, Any]:
    bench = Bench(dataclasses.replace(FULL, idle_counts=tuple(counts)), ["direct", *paths])
    bench.start()
    cpu: list[dict[str, Any]] = []
    try:
        for streams in counts:
            tps = min(20.0, max_rate / streams)
            per_path = bench.load_level(streams, tps, 6.0, rounds, bench.live())
            compare(per_path)
            cpu.append(
                {
                    "streams": streams,
                    "tps": tps,
                    "cpu_us_per_event": {
                        n: e.get("proxy_cpu_us_per_event") for n, e in per_path.items()
                    },
                    "other_cpu_util": {
                        n: [w.get("other_cpu_util") for w in e["windows"]]
                        for n, e in per_path.items()
                    },
                }
            )
        bench.idle_memory()
    finally:
        bench.stop()
    memory = [
        {
            "streams": entry["streams"],
            "kib_per_stream": {n: f.get("kib_per_stream") for n, f in entry["per_path"].items()},
        }
        for entry in bench.results["d_idle_memory"]["counts"]
    ]
    return {"cpu": cpu, "memory": memory}


def draw(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in doc["paths"]:
        cpu = [(c["streams"], c["cpu_us_per_event"].get(name)) for c in doc["cpu"]]
        left.plot(*zip(*[p for p in cpu if p[1]], strict=True), marker="o", label=name)
        mem = [(m["streams"], m["kib_per_stream"].get(name)) for m in doc["memory"]]
        right.plot(*zip(*[p for p in mem if p[1]], strict=True), marker="o", label=name)
    left.set(xscale="log", xlabel="streams", ylabel="CPU per event (µs)", ylim=(0, None))
    left.set_title("CPU per event (20/s a stream, at most 20,000 events/s)", fontsize=9)
    right.set(xscale="log", xlabel="idle streams open", ylabel="KiB per stream", ylim=(0, None))
    right.set_title("resident memory per idle stream", fontsize=9)
    for axes in (left, right):
        axes.grid(True, alpha=0.3)
        axes.legend()
    fig.suptitle(f"python -m bench.scale, {doc['started_at']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--counts", default="100,300,1000,3000,10000")
    parser.add_argument("--paths", default="sidecar-uvloop,nginx")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-rate", type=float, default=20_000.0)
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    paths = [p for p in args.paths.split(",") if p]
    counts = [int(c) for c in args.counts.split(",")]
    doc = {"started_at": started.isoformat(), "paths": paths}
    doc.update(measure(counts, paths, args.rounds, args.max_rate))
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    (OUT / f"scale-{stamp}.json").write_text(json.dumps(doc, indent=1) + "\n")
    draw(doc, OUT / "scale.png")
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
