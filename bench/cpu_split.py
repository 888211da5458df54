"""CPU per event split into user and system time, path by path, in alternating rounds.

``python -m bench run`` measures a path's CPU per event as a whole; this
says where it goes: the kernel's share (the reads, writes and wake-ups,
which a proxy cannot make cheaper than the system calls it needs) and the
process's own (what a faster proxy can win). Each round starts the
bench upstream and a path afresh, loads it with ``--streams`` × ``--tps``
events each at its own phase (every event its own read and write), and
reads the path's processes' ``utime`` and ``stime`` (``/proc/<pid>/stat``)
over ``--seconds`` once every stream streams. Events are the load's
nominal rate over the window (the bench client delivers it in full at
these loads: ``python -m bench run`` checks that).

    python -m bench.cpu_split --paths sidecar-uvloop,nginx --streams 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.instructions import RAMP_S, SETTLE_S, client_spec
from bench.paths import REPO, start_path, start_upstream
from bench.procfs import user_system_seconds


def one_round(path: str, streams: int, tps: float, seconds: float) -> dict[str, float]:
    """One path's user and system microseconds per event under one load."""
    work = Path(tempfile.mkdtemp(prefix="bench-cpu-split-"))
    upstream = start_upstream(work)
    running = start_path(path, upstream, work)
    client: subprocess.Popen[bytes] | None = None
    try:
        start_ns = time.monotonic_ns() + 1_000_000_000
        client = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.client",
                json.dumps(client_spec(running.port, streams, tps, seconds, work, start_ns)),
            ],
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The load runs on the client's clock: the window opens a second
        # after every stream is open and streaming.
        opens_at = start_ns + int((RAMP_S + SETTLE_S + 1) * 1e9)
        time.sleep(max(0.0, (opens_at - time.monotonic_ns()) / 1e9))
        user0, system0 = user_system_seconds(running.measured)
        began = time.monotonic()
        time.sleep(seconds)  # the measured window itself
        user1, system1 = user_system_seconds(running.measured)
        events = streams * tps * (time.monotonic() - began)
        return {
            "user_us": round(1e6 * (user1 - user0) / events, 2),
            "system_us": round(1e6 * (system1 - system0) / events, 2),
        }
    finally:
        if client is not None:
            client.kill()
            client.wait(timeout=30)
        running.stop()
        upstream.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__)
    parser.add_argument("--paths", default="sidecar-uvloop,nginx")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--tps", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    rounds: dict[str, list[dict[str, float]]] = {path: [] for path in paths}
    for _ in range(args.rounds):
        for path in paths:
            figures = one_round(path, args.streams, args.tps, args.seconds)
            rounds[path].append(figures)
            print(f"  {path:16} user {figures['user_us']:6.2f} us/event"
                  f"  system {figures['system_us']:6.2f} us/event", flush=True)  # fmt: skip
    result = {
        path: {
            "user_us": statistics.median(r["user_us"] for r in figures),
            "system_us": statistics.median(r["system_us"] for r in figures),
            "rounds": figures,
        }
        for path, figures in rounds.items()
    }
    print("RESULT " + json.dumps({"streams": args.streams, "tps": args.tps, "paths": result}))


if __name__ == "__main__":
    main()
