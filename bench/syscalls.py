"""System calls (and native CPU samples) per event of each path, under one stream load.

``python -m bench.syscalls --paths floor,sidecar-uvloop,nginx --streams 500``
starts the upstream and each path, runs one load window through each in
turn, and attaches a tracer to the path's process for exactly the measured
part of the window:

- ``--tool strace``: ``strace -c -f``; counts are divided by the events the
  client received in the window. strace stops the process at every system
  call, so the proxy runs slower under it (the window's delivered rate
  says by how much); the counts per event are what matters, not the time.
- ``--tool perf``: ``perf stat -e 'syscalls:sys_enter_*'``, the kernel's
  tracepoints, which cost the process almost nothing: the same counts, at
  full speed.
- ``--tool perf-record``: ``perf record`` (no call graphs) of the process,
  then ``perf report`` by symbol (self time, user and kernel), to see what
  the C under a Python proxy's loop spends its time on.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from bench.scenarios import FULL, Bench


def _tracer(tool: str, pid: int, seconds: float, out: Path) -> list[str]:
    if tool == "strace":
        return ["timeout", "-s", "INT", f"{seconds}", "strace", "-c", "-f", "-o", str(out),
                "-p", str(pid)]  # fmt: skip
    if tool == "perf":
        return ["perf", "stat", "-x", ",", "-o", str(out), "-e", "syscalls:sys_enter_*",
                "-p", str(pid), "--", "sleep", f"{seconds}"]  # fmt: skip
    graph = ["-g"] if tool == "perf-record-g" else []
    return ["perf", "record", *graph, "-F", "1999", "-o", str(out), "-p", str(pid),
            "--", "sleep", f"{seconds}"]  # fmt: skip


def _strace_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors], syscall
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            counts[parts[-1]] = int(parts[3])
    return counts


def _perf_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[0].isdigit() and "sys_enter_" in fields[2]:
            n = int(fields[0])
            if n:
                counts[fields[2].split("sys_enter_")[1]] = n
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.syscalls")
    parser.add_argument("--paths", required=True)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--tps", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--align", action="store_true")
    parser.add_argument(
        "--tool", choices=("strace", "perf", "perf-record", "perf-record-g"), default="perf"
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-syscalls"))
    args = parser.parse_args(argv)
    names = [n for n in args.paths.split(",") if n]
    if not shutil.which(args.tool.split("-")[0]):
        print(f"{args.tool} is not installed", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(FULL, ["direct", *names])
    bench.start()
    try:
        plan = bench.plan
        ramp = max(0.2, args.streams / plan.open_rate)
        delay = plan.start_delay_s + ramp + plan.settle_s
        for name in names:
            running = bench.paths[name]
            pid = running.measured[0]
            shape = "-aligned" if args.align else ""
            out = args.out / f"{name}-{args.streams}{shape}.{args.tool}"
            command = _tracer(args.tool, pid, args.seconds, out)
            tracers: list[subprocess.Popen[bytes]] = []
            timer = threading.Timer(
                delay,
                lambda command=command, tracers=tracers: tracers.append(
                    subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                ),
            )
            timer.start()
            window = bench.stream_window(name, args.streams, args.tps, args.seconds, args.align)
            timer.join()
            for tracer in tracers:
                _, err = tracer.communicate(timeout=args.seconds + 60)
                if tracer.returncode not in (0, 124, -2) and err:
                    print(err.decode(errors="replace")[-500:], file=sys.stderr)
            summary = window.windows[0]
            events = summary["delivered_events_per_s"] * args.seconds
            print(
                f"{name}: {args.streams} x {args.tps:g}/s{shape}, {args.tool} over "
                f"{args.seconds:g} s, delivered {summary['delivered_events_per_s']:.0f}/"
                f"{summary['offered_events_per_s']:.0f} ev/s, CPU/event under the tracer "
                f"{summary['proxy_cpu_us_per_event']} us"
            )
            threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
            print(f"  {threads} thread(s) in the process")
            if args.tool.startswith("perf-record"):
                by_dso = subprocess.run(
                    ["perf", "report", "-i", str(out), "--stdio", "--sort", "dso", "-g", "none"],
                    capture_output=True, text=True, timeout=120, check=False,
                ).stdout  # fmt: skip
                print("\n".join(ln for ln in by_dso.splitlines() if ln and ln[0] != "#"))
                report = subprocess.run(
                    [
                        *("perf", "report", "-i", str(out), "--stdio", "--sort", "dso,sym"),
                        *("-g", "none", "--percent-limit", "0.7"),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                ).stdout
                lines = [ln for ln in report.splitlines() if ln and not ln.startswith("#")]
                print("\n".join(lines[:45]))
                continue
            text = out.read_text()
            counts = _strace_counts(text) if args.tool == "strace" else _perf_counts(text)
            total = sum(counts.values())
            print(f"  per event: {total / events:.2f} system calls")
            for call, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
                print(f"    {call:<20} {n / events:7.3f}  ({n})")
            sys.stdout.flush()
    finally:
        bench.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
