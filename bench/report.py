"""The run's outputs: the JSON document, the Markdown tables, the targets and the plot."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench.paths import REPO, nginx_binary
from streamwarden._native import native_summary

__all__ = ["environment", "evaluate_targets", "markdown", "plot"]

SIDECARS = ("sidecar", "sidecar-uvloop")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source_state() -> dict[str, Any]:
    """Which code was measured: the commit, and any files of src/ changed since it."""
    changed = _git("status", "--porcelain", "--", "src")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "src_changed": [line[3:] for line in changed.splitlines()] if changed else [],
    }


def environment() -> dict[str, Any]:
    """What the numbers depend on: machine, kernel, interpreter, and each path's software."""
    nginx = nginx_binary()
    nginx_version = None
    if nginx is not None:
        done = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False)
        nginx_version = done.stderr.strip().removeprefix("nginx version: ")
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        # The sidecar runs on this interpreter and install: compiled or not.
        "streamwarden_code": native_summary(),
        "loadavg_at_start": list(os.getloadavg()),
        "source": source_state(),
        "versions": {
            name: _version(name)
            for name in (
                "streamwarden",
                "aiohttp",
                "uvloop",
                "uvicorn",
                "httptools",
                "fastapi",
                "starlette",
            )
        }
        | {"nginx": nginx_version},
    }


def _level(
    results: dict[str, Any], streams: int, scenario: str = "b_concurrency"
) -> dict[str, Any] | None:
    for level in results.get(scenario, {}).get("levels", []):
        if level["streams"] == streams:
            per_path: dict[str, Any] = level["per_path"]
            return per_path
    return None


def _get(data: Any, *keys: Any) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _idle_at(results: dict[str, Any], streams: int) -> dict[str, Any]:
    for count in _get(results, "d_idle_memory", "counts") or []:
        if count["planned_streams"] == streams:
            per_path: dict[str, Any] = count["per_path"]
            return per_path
    return {}


#: Issue 11's figures: (figure, unit, must, aim); each is met when measured <= the bound.
ISSUE_11 = {
    "cpu": ("CPU per event", "x nginx", 2.0, 1.5),
    "memory": ("resident memory per idle stream, 1,000 open", "KiB", 24.0, 20.0),
    "cancel": ("cancel, client FIN to upstream close, p99", "ms", 0.6, 0.4),
    "added": ("added latency per event, p99, over direct", "ms", 1.0, 0.5),
}

#: Issue 27's: the same CPU figures to tighter bounds, and memory at 10,000 open too.
ISSUE_27 = {
    "cpu": ("CPU per event", "x nginx", 1.5, 1.2),
    "memory": ("resident memory per idle stream", "KiB", 18.0, 15.0),
}

#: The two shapes of stream load: the results key and how the tables name it.
SHAPES = (("b_concurrency", "own phase"), ("g_aligned", "aligned"))


def evaluate_issue_11(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11's Speed table, for both sidecar loops (the default one is uvloop).

    Each entry has the must and the aim bounds, whether each is met (None if
    not measured), and nginx's own figure from the same run where it has one.
    """
    out: list[dict[str, Any]] = []
    cancel = _get(results, "e_cancel", "per_path") or {}
    idle = _idle_at(results, 1000)

    def add(kind: str, where: str, name: str, value: Any, nginx: Any, raw: Any = None) -> None:
        # ``raw``: the path's own figure where ``measured`` is a ratio (CPU: µs per event).
        out.append(_target(11, ISSUE_11[kind], where, name, value, nginx, raw))

    for name in SIDECARS:
        for key, shape in SHAPES:
            for streams in (500, 1000):
                level = _level(results, streams, key) or {}
                where = f", {streams:,} x 20/s, {shape}"
                add(
                    "cpu",
                    where,
                    name,
                    _get(level, name, "cpu_ratio_vs_nginx"),
                    _get(level, "nginx", "proxy_cpu_us_per_event"),
                    _get(level, name, "proxy_cpu_us_per_event"),
                )
        for key, shape in SHAPES:
            for streams in (500, 1000):
                level = _level(results, streams, key) or {}
                where = f", {streams:,} x 20/s, {shape}"
                add(
                    "added",
                    where,
                    name,
                    _get(level, name, "added_ms", "p99"),
                    _get(level, "nginx", "added_ms", "p99"),
                )
        add(
            "memory",
            "",
            name,
            _get(idle, name, "kib_per_stream"),
            _get(idle, "nginx", "kib_per_stream"),
        )
        p99 = _get(cancel, name, "ms", "p99")
        if _get(cancel, name, "missing"):
            p99 = float("inf")
        add("cancel", "", name, p99, _get(cancel, "nginx", "ms", "p99"))
    return out


def _target(
    issue: int,
    bounds: tuple[str, str, float, float],
    where: str,
    name: str,
    value: Any,
    nginx: Any,
    raw: Any = None,
) -> dict[str, Any]:
    figure, unit, must, aim = bounds
    return {
        "issue": issue,
        "target": f"{figure}{where}",
        "path": name,
        "measured": value,
        "unit": unit,
        "nginx": nginx,
        "raw": raw,
        "must": must,
        "aim": aim,
        "met": None if value is None else value <= must,
        "aim_met": None if value is None else value <= aim,
    }


def evaluate_issue_27(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 27's figures: CPU per event at most 1.5x nginx's, 18 KiB per idle stream."""
    out: list[dict[str, Any]] = []
    for name in SIDECARS:
        for key, shape in SHAPES:
            for streams in (500, 1000):
                level = _level(results, streams, key) or {}
                out.append(
                    _target(
                        27,
                        ISSUE_27["cpu"],
                        f", {streams:,} x 20/s, {shape}",
                        name,
                        _get(level, name, "cpu_ratio_vs_nginx"),
                        _get(level, "nginx", "proxy_cpu_us_per_event"),
                        _get(level, name, "proxy_cpu_us_per_event"),
                    )
                )
        for planned in (1000, 10_000):
            idle = _idle_at(results, planned)
            opened = _get(idle, name, "opened") or planned
            out.append(
                _target(
                    27,
                    ISSUE_27["memory"],
                    f", {opened:,} open",
                    name,
                    _get(idle, name, "kib_per_stream"),
                    _get(idle, "nginx", "kib_per_stream"),
                )
            )
    return out


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11's and 27's figures, then issue 7's targets; ``met`` is None if not measured."""
    return evaluate_issue_11(results) + evaluate_issue_27(results) + evaluate_issue_7(results)


def evaluate_issue_7(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 7's targets, each judged for both sidecar loops; ``met`` is None if not measured."""
    out: list[dict[str, Any]] = []
    at200 = _level(results, 200)
    at1000 = _level(results, 1000)
    cancel = _get(results, "e_cancel", "per_path") or {}
    idle = _get(results, "d_idle_memory", "per_path") or {}
    rates = _get(results, "c_max_rate", "per_path") or {}

    def add(target: str, name: str, value: float | None, limit: float, unit: str) -> None:
        met = None if value is None else value < limit if unit != "events/s" else value >= limit
        if unit == "events/s" and met is False and not _get(rates, name, "first_miss"):
            met = None  # the plan's levels stopped below the target before the path did
        out.append(
            {
                "issue": 7,
                "target": target,
                "path": name,
                "measured": value,
                "unit": unit,
                "met": met,
            }
        )

    for name in SIDECARS:
        p99 = _get(cancel, name, "ms", "p99")
        if _get(cancel, name, "missing"):
            p99 = float("inf")
        add("cancel propagation p99 < 1 ms", name, p99, 1.0, "ms")
        add(
            "added per-event p99 < 1 ms at 200 x 20/s",
            name,
            _get(at200, name, "added_ms", "p99"),
            1.0,
            "ms",
        )
        add(
            "added per-event p99 < 2 ms at 1000 x 20/s",
            name,
            _get(at1000, name, "added_ms", "p99"),
            2.0,
            "ms",
        )
        add(
            "one process sustains >= 50,000 events/s",
            name,
            _get(rates, name, "sustained_events_per_s"),
            50_000,
            "events/s",
        )
        add(
            "<= 24 KiB resident per idle stream",
            name,
            _get(idle, name, "kib_per_stream"),
            24.0001,
            "KiB",
        )
        cpu_ratio = _get(at1000, name, "cpu_ratio_vs_nginx")
        add("CPU per event <= 2x nginx (1000 x 20/s)", name, cpu_ratio, 2.0001, "x nginx")
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == float("inf"):
            return "never"
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _x(value: Any) -> str:
    return "–" if value is None else f"{value:.2f}×"


def markdown(doc: dict[str, Any]) -> str:
    r = doc["results"]
    env = doc["environment"]
    lines = [
        f"# streamwarden benchmark: {doc['plan']} run of {doc['started_at']}",
        "",
        f"Command: `{doc['command']}` ({r.get('duration_s', '?')} s). "
        f"Machine: {env['cpus']} cores, "
        f"Linux {env['kernel']}, Python {env['python']}"
        + (f" ({env['streamwarden_code']})" if env.get("streamwarden_code") else "")
        + ", load average at start "
        f"{', '.join(f'{x:.2f}' for x in env['loadavg_at_start'])}"
        + (f", bench processes at nice {env['nice']}" if env.get("nice") else "")
        + ".",
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
        + ".",
        *_source_line(env.get("source")),
        *_noise_line(r),
        "",
        "All times in milliseconds. *Added* = the path's percentile minus the direct "
        "path's percentile from the same scenario of the same run; ×direct and ×nginx "
        "are ratios of the raw percentiles. Every latency is upstream send to client "
        "receive of one event, on one monotonic clock.",
        "",
    ]
    if doc.get("unavailable"):
        lines += [
            "Paths not measured: " + "; ".join(f"{k} ({v})" for k, v in doc["unavailable"].items()),
            "",
        ]
    yes_no = {True: "yes", False: "**no**", None: "not measured"}
    lines += _issue_11_table(doc)
    lines += _issue_11_table(doc, issue=27)
    lines += ["## Targets (issue 7)", "", "| target | path | measured | met |", "|---|---|---|---|"]
    for t in doc["targets"]:
        if t.get("issue", 7) != 7:
            continue
        met = yes_no[t["met"]]
        lines.append(
            f"| {t['target']} | {t['path']} | {_fmt(t['measured'], 3)} {t['unit']} | {met} |"
        )
    lines.append("")

    single = r.get("a_single_stream")
    if single:
        lines += [
            f"## (a) One stream at {single['tps']:g} events/s: per-event latency",
            "",
            "| path | p50 | p99 | max | added p50 | added p99 | ×direct p99 | ×nginx p99 "
            "| events |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, e in single["per_path"].items():
            lat, add = e["latency_ms"], e["added_ms"]
            lines.append(
                f"| {name} | {_fmt(lat['p50'])} | {_fmt(lat['p99'])} | {_fmt(lat['max'])} | "
                f"{_fmt(add['p50'])} | {_fmt(add['p99'])} | {_x(e['ratio_vs_direct']['p99'])} | "
                f"{_x(e['ratio_vs_nginx']['p99'])} | {lat['n']:,} |"
            )
        lines.append("")

    sweep = r.get("b_concurrency")
    if sweep and sweep["levels"]:
        lines += [
            f"## (b) Concurrent streams at {sweep['tps']:g} events/s each, each at its own phase",
            "",
            "Streams start spread over a ramp, so each one's events come at its own phase: "
            "every event is its own upstream write and read. CPU per event is the proxy "
            "process's CPU time in the window over the events delivered in it; `load` is "
            "CPU use of proxy / upstream / client, and of everything else on the machine "
            "(other jobs) in the same window.",
            "",
            *_load_table(sweep["levels"]),
            "",
        ]

    aligned = r.get("g_aligned")
    if aligned and aligned["levels"]:
        lines += [
            f"## (g) Concurrent streams at {aligned['tps']:g} events/s each, in one decode step",
            "",
            "Every stream's events come in the upstream's one shared decode step (one "
            "timer writes one event to each stream in turn, as a batching engine emits "
            "the tokens of one step), so a proxy gets a burst of one event per stream "
            "every 1/20 s; the later events of a burst wait for the earlier ones, in "
            "the upstream, the proxy and the client alike. Columns as in (b).",
            "",
            *_load_table(aligned["levels"]),
            "",
        ]

    rates = r.get("c_max_rate")
    if rates:
        lines += [
            f"## (c) Highest sustained aggregate event rate ({rates['criterion']})",
            "",
            "| path | events/s | streams | p99 added | proxy CPU | first level missed |",
            "|---|---|---|---|---|---|",
        ]
        for name, e in rates["per_path"].items():
            miss = e.get("first_miss")
            miss_text = (
                f"{miss['streams']:,} streams: {_fmt(miss['delivered_events_per_s'], 0)} of "
                f"{_fmt(miss['events_per_s'], 0)} ev/s, p99 added {_fmt(miss['p99_added_ms'])}"
                + ("" if miss["direct_kept_up"] else " (harness itself saturated)")
                if miss
                else "none"
            )
            cpu = e.get("proxy_cpu_util")
            if e.get("refined"):
                miss_text += "; bisection: " + ", ".join(
                    f"{step['streams']:,} {'ok' if step['sustained'] else 'missed'}"
                    for step in e["refined"]
                )
            lines.append(
                f"| {name} | {_fmt(e['sustained_events_per_s'], 0)} | {_fmt(e['streams'])} | "
                f"{_fmt(e.get('p99_added_ms'))} | {'–' if cpu is None else f'{cpu * 100:.0f}%'} | "
                f"{miss_text} |"
            )
        lines.append("")

    idle = r.get("d_idle_memory")
    if idle:
        # Runs before the 1,000-stream count had only the one, at the top level.
        counts = idle.get("counts") or [
            {
                "streams": idle["streams"],
                "planned_streams": idle.get("planned_streams", idle["streams"]),
                "per_path": idle["per_path"],
            }
        ]
        capped = [c for c in counts if c["planned_streams"] > c["streams"]]
        lines += [
            "## (d) Idle streams: resident memory per open stream",
            "",
            "Each count in a freshly started proxy (after a warm-up of a few streams): "
            "(RSS with the streams open − RSS before) / streams.",
            "",
            *(
                [
                    f"Planned {capped[0]['planned_streams']:,}; a proxied stream holds two "
                    f"sockets in the proxy and this machine's descriptor limit is "
                    f"{idle['fd_limit']:,} per process (not raisable here), so the run used "
                    f"{capped[0]['streams']:,}, the largest count that fits.",
                    "",
                ]
                if capped
                else []
            ),
            "| streams | path | opened | RSS before KiB | RSS open KiB | KiB/stream | ×nginx |",
            "|---|---|---|---|---|---|---|",
        ]
        for count in counts:
            for name, e in count["per_path"].items():
                if "error" in e:
                    lines.append(
                        f"| {count['streams']:,} | {name} | failed: {e['error'][:80]} | | | | |"
                    )
                    continue
                lines.append(
                    f"| {count['streams']:,} | {name} | {e['opened']:,} | "
                    f"{e['rss_before_kib']:,} | {e['rss_open_kib']:,} | "
                    f"{_fmt(e['kib_per_stream'], 1)} | {_x(e.get('ratio_vs_nginx'))} |"
                )
        lines.append("")

    cancel = r.get("e_cancel")
    if cancel:
        lines += [
            "## (e) Cancel propagation: client FIN to upstream close, upstream silent",
            "",
            "| path | p50 | p99 | max | added p99 | ×nginx p99 | never closed (1 s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, e in cancel["per_path"].items():
            ms = e["ms"]
            lines.append(
                f"| {name} | {_fmt(ms['p50'])} | {_fmt(ms['p99'])} | {_fmt(ms['max'])} | "
                f"{_fmt(e['added_ms']['p99'])} | {_x(e['ratio_vs_nginx']['p99'])} | "
                f"{e['missing']} of {cancel['samples']} |"
            )
        lines.append("")

    ttft = r.get("f_ttft")
    if ttft:
        lines += [
            "## (f) Time to first token: overhead per request (new connection each)",
            "",
            "| path | streamed p50 | overhead p50 | overhead p99 | non-streamed p50 "
            "| overhead p50 | overhead p99 |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, e in ttft["per_path"].items():
            so = e.get("streamed_overhead_ms", {})
            wo = e.get("whole_overhead_ms", {})
            lines.append(
                f"| {name} | {_fmt(e['streamed_ms']['p50'])} | {_fmt(so.get('p50'))} | "
                f"{_fmt(so.get('p99'))} | {_fmt(e['whole_ms']['p50'])} | {_fmt(wo.get('p50'))} | "
                f"{_fmt(wo.get('p99'))} |"
            )
        lines.append("")
    return "\n".join(lines)


def _issue_11_table(doc: dict[str, Any], issue: int = 11) -> list[str]:
    """Issue 11's (or 27's) Speed figures: one row per figure, the sidecar's loops side by side."""
    targets = [t for t in doc["targets"] if t.get("issue") == issue]
    names = [n for n in ("sidecar-uvloop", "sidecar") if n in doc["paths"]]
    if not targets or not names:
        return []
    yes_no = {True: "yes", False: "**no**", None: "not measured"}
    rows: dict[str, dict[str, Any]] = {}
    for t in targets:
        rows.setdefault(t["target"], {})[t["path"]] = t
    heads = {"sidecar-uvloop": "sidecar-uvloop (the default loop)", "sidecar": "sidecar (asyncio)"}
    lines = [
        f"## Targets (issue {issue})",
        "",
        "CPU per event as a ratio to nginx's in the same windows (each path's own µs in "
        "brackets); *must met* / *aim met* are per path, met when the figure is at or "
        "under the bound.",
        "",
        "| figure | must | aim | nginx | "
        + " | ".join(f"{heads[n]} | must met | aim met" for n in names)
        + " |",
        "|---|---|---|---|" + "---|---|---|" * len(names),
    ]

    def value(t: dict[str, Any], key: str) -> str:
        v = t[key]
        if v is None:
            return "–"
        if t["unit"] == "x nginx":
            if key == "nginx":
                return f"({_fmt(v, 1)} µs)"
            raw = t.get("raw")
            return f"{v:.2f}×" + (f" ({_fmt(raw, 1)} µs)" if raw is not None else "")
        return f"{_fmt(v, 3)} {t['unit']}"

    for figure, per_path in rows.items():
        first = next(iter(per_path.values()))
        unit = "×" if first["unit"] == "x nginx" else f" {first['unit']}"
        cells = [
            figure,
            f"≤ {first['must']:g}{unit}",
            f"≤ {first['aim']:g}{unit}",
            value(first, "nginx"),
        ]
        for name in names:
            t = per_path.get(name)
            if t is None:
                cells += ["–", "–", "–"]
                continue
            cells += [value(t, "measured"), yes_no[t["met"]], yes_no[t["aim_met"]]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _noise_line(results: dict[str, Any]) -> list[str]:
    """How much of the machine other jobs took during the load windows (the run's noise)."""
    others = sorted(
        w["other_cpu_util"]
        for key in ("b_concurrency", "g_aligned")
        for level in results.get(key, {}).get("levels", [])
        for entry in level["per_path"].values()
        for w in entry["windows"]
        if "other_cpu_util" in w
    )
    if not others:
        return []
    median = others[len(others) // 2]
    line = (
        f"Other jobs on the machine during the load windows of (b) and (g): median "
        f"{median * 100:.0f}% of one core, most {others[-1] * 100:.0f}% (of {len(others)} "
        "windows; the machine has 200%)."
    )
    if median > 0.3:
        line += (
            " **A noisy run:** the latencies (and to a lesser degree the CPU figures) "
            "are not the proxies' alone; compare paths within this run only."
        )
    return [line]


def _source_line(source: dict[str, Any] | None) -> list[str]:
    if not source or not source.get("commit"):
        return []
    changed = source.get("src_changed") or []
    return [
        f"Code: commit {source['commit'][:12]}"
        + (f", with uncommitted changes to {', '.join(changed)}" if changed else "")
        + "."
    ]


def _load_table(levels: list[dict[str, Any]]) -> list[str]:
    """Scenario (b)'s or (g)'s table: one row per level and path."""
    lines = [
        "| streams | path | p50 | p99 | added p50 | added p99 | ×direct p99 | ×nginx p99 "
        "| CPU µs/event | ×nginx CPU | delivered/offered ev/s | load proxy/up/client/other |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        for name, e in level["per_path"].items():
            lat, add = e["latency_ms"], e["added_ms"]
            w: dict[str, Any] = next((w for w in e["windows"] if "error" not in w), {})
            util = w.get("cpu_util", {})
            load = (
                "/".join(
                    f"{util.get(k, 0) * 100:.0f}%" if k in util else "–"
                    for k in ("proxy", "upstream", "client")
                )
                + f"/{w.get('other_cpu_util', 0) * 100:.0f}%"
            )
            lines.append(
                f"| {level['streams']:,} | {name} | {_fmt(lat['p50'])} | {_fmt(lat['p99'])} | "
                f"{_fmt(add['p50'])} | {_fmt(add['p99'])} | "
                f"{_x(e['ratio_vs_direct']['p99'])} | {_x(e['ratio_vs_nginx']['p99'])} | "
                f"{_fmt(e.get('proxy_cpu_us_per_event'), 1)} | "
                f"{_x(e.get('cpu_ratio_vs_nginx'))} | "
                f"{_fmt(e.get('delivered_events_per_s'), 0)}/"
                f"{_fmt(e.get('offered_events_per_s'), 0)} | "
                f"{load} |"
            )
    return lines


def plot(doc: dict[str, Any], out: Path) -> bool:
    """Latency percentiles and CPU per event against concurrency, one line per path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = doc["results"].get("b_concurrency", {}).get("levels", [])
    aligned = doc["results"].get("g_aligned", {}).get("levels", [])
    if not levels:
        return False
    names: list[str] = []
    for level in levels:
        for name in level["per_path"]:
            if name not in names:
                names.append(name)
    fig, (ax_lat, ax_cpu) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        xs, p50, p99, cpu_x, cpu = [], [], [], [], []
        for level in levels:
            e = level["per_path"].get(name)
            if not e or e["latency_ms"]["p50"] is None:
                continue
            xs.append(level["streams"])
            p50.append(e["latency_ms"]["p50"])
            p99.append(e["latency_ms"]["p99"])
            if e.get("proxy_cpu_us_per_event"):
                cpu_x.append(level["streams"])
                cpu.append(e["proxy_cpu_us_per_event"])
        color = colors[i % len(colors)]
        ax_lat.plot(xs, p50, "o-", color=color, label=f"{name} p50")
        ax_lat.plot(xs, p99, "s--", color=color, label=f"{name} p99")
        if cpu:
            ax_cpu.plot(cpu_x, cpu, "o-", color=color, label=name)
        in_step = [
            (level["streams"], e["proxy_cpu_us_per_event"])
            for level in aligned
            if (e := level["per_path"].get(name)) and e.get("proxy_cpu_us_per_event")
        ]
        if in_step:
            ax_cpu.plot(*zip(*in_step, strict=True), "x:", color=color, label=f"{name} aligned")
    tps = doc["results"]["b_concurrency"]["tps"]
    ax_lat.set(
        xscale="log",
        yscale="log",
        xlabel=f"concurrent streams ({tps:g} events/s each)",
        ylabel="upstream send → client receive (ms)",
        title="Per-event latency by path",
    )
    ax_lat.grid(True, which="both", alpha=0.3)
    ax_lat.legend(fontsize=7, ncol=2)
    ax_cpu.set(
        xscale="log",
        xlabel=f"concurrent streams ({tps:g} events/s each)",
        ylabel="proxy CPU per event (µs)",
        title="Proxy CPU per event (dotted: all streams in one decode step)",
    )
    ax_cpu.grid(True, which="both", alpha=0.3)
    ax_cpu.legend(fontsize=8)
    fig.suptitle(f"streamwarden bench, {doc['plan']} run, {doc['started_at']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
