"""Scenario (d) alone: resident memory per idle stream, for a before/after of two builds.

Run it in a tree of each build, with that build installed in its own venv,
alternating the two (the machine drifts; the harness cannot put two venvs
in one run)::

    PYTHONPATH=<tree> <venv>/bin/python -m bench.idle_memory --counts 1000,10000

Each path gets a fresh process per count, a warm-up, then the streams
(capped to what the descriptor limit allows: two sockets a stream); it
prints one ``RESULT`` JSON line of KiB per stream, path by path and count
by count, nginx's beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from bench.scenarios import FULL, Bench


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_memory")
    parser.add_argument("--counts", default="1000,10000")
    parser.add_argument("--paths", default="sidecar-uvloop,nginx")
    args = parser.parse_args()
    counts = tuple(int(c) for c in args.counts.split(","))
    paths = [p for p in args.paths.split(",") if p]
    bench = Bench(dataclasses.replace(FULL, idle_counts=counts), ["direct", *paths])
    bench.start()
    try:
        bench.idle_memory()
    finally:
        bench.stop()
    result = {
        str(entry["streams"]): {
            name: figures.get("kib_per_stream", figures.get("error"))
            for name, figures in entry["per_path"].items()
        }
        for entry in bench.results["d_idle_memory"]["counts"]
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
