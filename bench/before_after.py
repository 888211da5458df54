"""One build's CPU per event and idle memory, for a before/after of two commits.

Run it in a tree of each commit, with that commit installed in its own venv
(compiled, as a user gets it), one after the other on a quiet machine::

    PYTHONPATH=<tree> <venv>/bin/python -m bench.before_after

It measures 500 streams x 20 events/s at their own phases, three
interleaved rounds of 8 s of the compiled sidecar (uvloop), its sources
and nginx, then resident memory per idle stream with 1,000 open, and
prints one ``RESULT`` JSON line.
"""

from __future__ import annotations

import dataclasses
import json

from bench.scenarios import FULL, Bench, compare

PATHS = ["sidecar-uvloop", "sidecar-source", "nginx"]


def main() -> None:
    bench = Bench(dataclasses.replace(FULL, idle_counts=(1000,)), PATHS)
    bench.start()
    try:
        per_path = bench.load_level(500, 20.0, 8.0, 3, bench.live())
        compare(per_path)
        measured = {name: entry for name, entry in per_path.items() if name != "direct"}
        bench.paths.pop("nginx").stop()  # idle memory of the sidecars only
        bench.idle_memory()
    finally:
        bench.stop()
    idle = bench.results.get("d_idle_memory", {}).get("per_path", {})
    result = {
        "cpu_windows": {
            name: [w.get("proxy_cpu_us_per_event") for w in entry["windows"]]
            for name, entry in measured.items()
        },
        "cpu": {name: entry.get("proxy_cpu_us_per_event") for name, entry in measured.items()},
        "idle_kib": {name: entry.get("kib_per_stream") for name, entry in idle.items()},
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
