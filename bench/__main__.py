"""``python -m bench run [--quick]`` and ``python -m bench profile``.

``run`` starts the upstream and every path, runs the scenarios, and writes
``<out>/<timestamp>.json``, ``<out>/latest.md`` and ``<out>/latest.png``
(``bench/results`` for a full run, ``bench/results/quick`` for ``--quick``,
which is what CI runs: seconds long, to keep the harness working, not to
produce numbers).

``report FILE`` writes a results file's tables and plot again (after a
change to :mod:`bench.report`). ``profile`` loads one path and samples its
process with py-spy (see :mod:`bench.profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

from bench.paths import ALL_PATHS, KNOWN_PATHS, REPO
from bench.report import SIDECARS, environment, evaluate_targets, markdown, plot
from bench.scenarios import FULL, QUICK, Bench


def _paths(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [
        n
        for n in names
        if n not in KNOWN_PATHS
        and not n.startswith("floor-burn")
        and n.split("+")[0] not in ("sidecar", "sidecar-uvloop")
    ]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown path(s) {unknown}; known: {list(KNOWN_PATHS)}")
    if "direct" not in names:
        names.insert(0, "direct")  # the baseline every comparison needs
    return names


README = REPO / "bench" / "README.md"
_START = "<!-- latest results: written by `python -m bench run`; do not edit by hand -->"
_END = "<!-- end of latest results -->"


def publish(tables: str) -> None:
    """Put a full run's tables into bench/README.md, between the two markers."""
    if not README.exists():
        return
    text = README.read_text()
    if _START not in text or _END not in text:
        return
    head, rest = text.split(_START, 1)
    _, tail = rest.split(_END, 1)
    # The run's own title becomes a sub-heading under the README's section.
    body = tables.replace("# streamwarden benchmark: ", "### ", 1).replace("\n## ", "\n#### ")
    README.write_text(f"{head}{_START}\n\n{body}\n\n![latest](results/latest.png)\n\n{_END}{tail}")


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    out: Path = args.out or (REPO / "bench" / "results" / ("quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    command = "python -m bench run" + (" --quick" if args.quick else "")
    if args.paths != list(ALL_PATHS):
        command += " --paths " + ",".join(args.paths)
    if args.nice:
        # Children (upstream, proxies, clients) inherit the niceness.
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        command += f" --nice {args.nice}"
    env = environment()
    env["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
    bench = Bench(plan, args.paths)
    print(f"bench: {plan.name} run, paths {', '.join(args.paths)}", file=sys.stderr)
    results = bench.run()
    doc = {
        "schema": 1,
        "command": command,
        "plan": plan.name,
        "started_at": started.isoformat(),
        "environment": env,
        "paths": {
            name: {"description": r.description, **r.details} for name, r in bench.paths.items()
        },
        "unavailable": bench.unavailable,
        "results": results,
    }
    doc["targets"] = evaluate_targets(results)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    json_path = out / f"{stamp}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    (out / "latest.md").write_text(markdown(doc) + "\n")
    plotted = plot(doc, out / "latest.png") if not args.no_plot else False
    if not args.quick and args.out is None:
        publish(markdown(doc))
    print(
        f"bench: wrote {json_path}, {out / 'latest.md'}"
        + (f", {out / 'latest.png'}" if plotted else " (no plot: matplotlib missing)"),
        file=sys.stderr,
    )
    return 0


def rerender(args: argparse.Namespace) -> int:
    """A results file's tables and plot again, with the current report code."""
    doc = json.loads(args.file.read_text())
    doc["targets"] = evaluate_targets(doc["results"])
    out: Path = args.file.parent
    (out / "latest.md").write_text(markdown(doc) + "\n")
    if not args.no_plot:
        plot(doc, out / "latest.png")
    if doc["plan"] == "full" and out.resolve() == (REPO / "bench" / "results").resolve():
        publish(markdown(doc))
    print(f"bench: wrote {out / 'latest.md'} from {args.file}", file=sys.stderr)
    return 0


def experiment(args: argparse.Namespace) -> int:
    """The base sidecar and each patched variant, interleaved windows, one load level."""
    from bench.scenarios import compare

    names = ["direct", args.base] + [f"{args.base}+{v}" for v in args.variants]
    plan = dataclasses.replace(FULL, ttft_samples=args.ttft, cancel_samples=args.cancel)
    bench = Bench(plan, names)
    bench.start()
    try:
        if args.ttft:
            bench.ttft()
        if args.cancel:
            bench.cancel()
        per_path = bench.load_level(
            args.streams, args.tps, args.seconds, args.rounds, bench.live(), align=args.align
        )
    finally:
        bench.stop()
    compare(per_path)
    base_cpu = per_path.get(args.base, {}).get("proxy_cpu_us_per_event")
    shape = "one decode step" if args.align else "each at its own phase"
    print(f"{args.streams} streams x {args.tps:g}/s ({shape}), {args.rounds} interleaved rounds:")
    for name, entry in per_path.items():
        cpu = entry.get("proxy_cpu_us_per_event")
        per_window = [w.get("proxy_cpu_us_per_event") for w in entry["windows"]]
        change = f" ({(cpu / base_cpu - 1) * 100:+.0f}%)" if cpu and base_cpu else ""
        print(
            f"  {name:<40} CPU/event {cpu} us{change} windows {per_window} "
            f"p50 {entry['latency_ms']['p50']} p99 {entry['latency_ms']['p99']} ms "
            f"added p99 {entry['added_ms']['p99']} ms"
        )
    return 0


RESUME_PATHS = ["direct", "sidecar-uvloop", "sidecar-resume", "sidecar-resume-redis", "nginx"]


def _cpu_cell(name: str, value: float | None, plain: float | None) -> str:
    if value is None:
        return "–"
    if name in ("sidecar-uvloop", "nginx") or not plain:
        return f"{value} µs"
    return f"{value} µs ({value / plain:.2f}×)"


def resume_cost(args: argparse.Namespace) -> int:
    """What a resumable route costs next to a plain one: CPU per event, memory per stream.

    The same interleaved windows for the plain sidecar, the sidecar on a
    resumable route with the memory store and with Redis, and nginx; then
    idle streams in a fresh process of each sidecar.
    """
    from bench.scenarios import compare

    plan = dataclasses.replace(FULL, idle_counts=(args.idle,))
    bench = Bench(plan, RESUME_PATHS)
    started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    bench.start()
    levels: dict[int, dict[str, object]] = {}
    try:
        for streams in args.streams:
            per_path = bench.load_level(streams, args.tps, args.seconds, args.rounds, bench.live())
            compare(per_path)
            levels[streams] = per_path
        bench.paths.pop("nginx").stop()  # idle memory of the sidecars only
        bench.idle_memory()
    finally:
        bench.stop()
    idle = bench.results.get("d_idle_memory", {}).get("per_path", {})
    rows = [
        f"Command: `python -m bench resume-cost` ({started.isoformat()}); "
        f"{args.rounds} interleaved rounds of {args.seconds:g} s per level, "
        f"each stream at its own phase; idle memory with {args.idle} open.",
        "",
        "| figure | plain sidecar | resumable, memory store | resumable, Redis | nginx |",
        "|---|---|---|---|---|",
    ]
    for streams, per_path in levels.items():
        cpu = {n: per_path.get(n, {}).get("proxy_cpu_us_per_event") for n in RESUME_PATHS}  # type: ignore[union-attr]
        cells = [_cpu_cell(n, cpu[n], cpu["sidecar-uvloop"]) for n in RESUME_PATHS[1:]]
        rows.append(f"| CPU per event, {streams:,} × {args.tps:g}/s | " + " | ".join(cells) + " |")
    memory = {n: idle.get(n, {}).get("kib_per_stream") for n in RESUME_PATHS[1:4]}
    rows.append(
        f"| resident memory per idle stream, {args.idle:,} open | "
        + " | ".join(f"{memory[n]} KiB" if memory[n] else "–" for n in RESUME_PATHS[1:4])
        + " | – |"
    )
    table = "\n".join(rows)
    out = REPO / "bench" / "results" / f"resume-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    out.write_text(
        json.dumps({"levels": levels, "idle": idle, "table": table}, indent=1, default=str) + "\n"
    )
    print(table)
    print(f"bench: wrote {out}", file=sys.stderr)


def compare_paths(args: argparse.Namespace) -> int:
    """Named paths at load levels, interleaved rounds, CPU per event as a ratio to nginx's.

    Each ratio is of windows of the same round (the machine is shared, and
    drifts: a ratio within a round is what holds up). Prints one JSON line
    per level after the human-readable lines, for the record.
    """
    from bench.scenarios import compare

    names = args.paths
    bench = Bench(FULL, names)
    bench.start()
    out = []
    try:
        for streams in args.streams:
            for align in [False, True] if args.both else [args.align]:
                per_path = bench.load_level(
                    streams, args.tps, args.seconds, args.rounds, bench.live(), align=align
                )
                compare(per_path)
                shape = "aligned" if align else "own phase"
                nginx = per_path.get("nginx", {}).get("windows", [])
                print(f"{streams} streams x {args.tps:g}/s, {shape}, {args.rounds} rounds:")
                level = {"streams": streams, "tps": args.tps, "aligned": align, "paths": {}}
                for name, entry in per_path.items():
                    if name == "direct":
                        continue
                    cpu = [w.get("proxy_cpu_us_per_event") for w in entry["windows"]]
                    ratios = [
                        round(c / n["proxy_cpu_us_per_event"], 2)
                        if c and "proxy_cpu_us_per_event" in n and n["proxy_cpu_us_per_event"]
                        else None
                        for c, n in zip(cpu, nginx, strict=False)
                    ]
                    other = [w.get("other_cpu_util") for w in entry["windows"]]
                    print(
                        f"  {name:<16} CPU/event {entry.get('proxy_cpu_us_per_event')} us "
                        f"windows {cpu} x nginx per round {ratios} other {other} "
                        f"p99 {entry['latency_ms']['p99']} ms "
                        f"delivered {entry.get('delivered_events_per_s')}"
                    )
                    level["paths"][name] = {
                        "cpu_us_per_event": cpu,
                        "x_nginx": ratios,
                        "other_cpu_util": other,
                        "p99_ms": entry["latency_ms"]["p99"],
                    }
                out.append(level)
                print("JSON " + json.dumps(level), flush=True)
    finally:
        bench.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the benchmark")
    run_parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    run_parser.add_argument("--out", type=Path, help="results directory")
    run_parser.add_argument(
        "--paths", type=_paths, default=list(ALL_PATHS), help=f"comma list of {list(ALL_PATHS)}"
    )
    run_parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    run_parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority for every bench process (e.g. -10 on a machine shared "
        "with other jobs; negative values need root)",
    )
    report_parser = commands.add_parser(
        "report", help="write a results file's tables (latest.md, bench/README.md) and plot again"
    )
    report_parser.add_argument("file", type=Path, help="a results JSON of `bench run`")
    report_parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    profile_parser = commands.add_parser("profile", help="py-spy profile of one path under load")
    profile_parser.add_argument(
        "--path", default="sidecar", help="a Python path, or a patched sidecar (sidecar+PATCH)"
    )
    profile_parser.add_argument("--streams", type=int, default=1000)
    profile_parser.add_argument("--tps", type=float, default=20.0)
    profile_parser.add_argument("--seconds", type=float, default=10.0)
    profile_parser.add_argument("--out", type=Path, help="collapsed-stack output file")
    profile_parser.add_argument(
        "--align",
        action="store_true",
        help="every stream's events in one decode step (scenario g), not each at its own phase",
    )
    profile_parser.add_argument(
        "--native", action="store_true", help="C frames too (py-spy --native)"
    )
    profile_parser.add_argument(
        "--requests", type=int, default=0, help="profile N sequential requests instead of streams"
    )
    profile_parser.add_argument(
        "--memory", action="store_true", help="tracemalloc per idle stream (in-process sidecar)"
    )
    resume_parser = commands.add_parser(
        "resume-cost", help="a resumable route (memory store, Redis) against a plain one"
    )
    resume_parser.add_argument(
        "--streams", type=lambda v: [int(x) for x in v.split(",")], default=[500, 1000]
    )
    resume_parser.add_argument("--tps", type=float, default=20.0)
    resume_parser.add_argument("--seconds", type=float, default=8.0)
    resume_parser.add_argument("--rounds", type=int, default=2)
    resume_parser.add_argument("--idle", type=int, default=1000)
    experiment_parser = commands.add_parser(
        "experiment", help="a proposed hot-path change (bench/experiments.py) against the sidecar"
    )
    experiment_parser.add_argument(
        "variants", nargs="+", help="patch sets, e.g. no-gap-metrics no-gap-metrics+body-bytes"
    )
    experiment_parser.add_argument("--base", default="sidecar", choices=SIDECARS)
    experiment_parser.add_argument("--streams", type=int, default=1000)
    experiment_parser.add_argument("--tps", type=float, default=20.0)
    experiment_parser.add_argument("--seconds", type=float, default=3.0)
    experiment_parser.add_argument("--rounds", type=int, default=3)
    experiment_parser.add_argument(
        "--align", action="store_true", help="every stream's events in one decode step"
    )
    experiment_parser.add_argument(
        "--ttft", type=int, default=0, help="also N TTFT samples per variant (scenario f)"
    )
    experiment_parser.add_argument(
        "--cancel", type=int, default=0, help="also N cancel samples per variant (scenario e)"
    )
    filters_parser = commands.add_parser(
        "filters-cost",
        help="output filters: relay CPU per event on vs off, and the hold-back latency",
    )
    filters_parser.add_argument("--rounds", type=int, default=60)
    filters_parser.add_argument("--streams", type=int, default=20)
    filters_parser.add_argument("--tps", type=float, default=50.0)
    filters_parser.add_argument("--events", type=int, default=500, help="events per stream")
    filters_parser.add_argument("--no-latency", action="store_true", help="CPU only")
    filters_parser.add_argument(
        "--instructions", action="store_true", help="also count instructions (valgrind)"
    )
    filters_parser.add_argument("--passes", type=int, default=3, help="counted passes")
    compare_parser = commands.add_parser(
        "compare", help="named paths (e.g. floor) A/B, CPU per event per round as x nginx"
    )
    compare_parser.add_argument("--paths", type=_paths, required=True)
    compare_parser.add_argument(
        "--streams", type=lambda v: [int(x) for x in v.split(",")], default=[500]
    )
    compare_parser.add_argument("--tps", type=float, default=20.0)
    compare_parser.add_argument("--seconds", type=float, default=8.0)
    compare_parser.add_argument("--rounds", type=int, default=2)
    compare_parser.add_argument("--align", action="store_true", help="one decode step")
    compare_parser.add_argument("--both", action="store_true", help="own phase, then aligned")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare_paths(args)
    if args.command == "run":
        return run(args)
    if args.command == "resume-cost":
        return resume_cost(args)
    if args.command == "filters-cost":
        from bench.filters_cost import filters_cost

        return filters_cost(args)
    if args.command == "experiment":
        return experiment(args)
    if args.command == "report":
        return rerender(args)
    from bench.profile import memory_profile, profile

    if args.memory:
        return memory_profile(args.streams)
    return profile(
        args.path,
        args.streams,
        args.tps,
        args.seconds,
        args.out,
        args.requests,
        args.align,
        args.native,
    )


if __name__ == "__main__":
    sys.exit(main())
