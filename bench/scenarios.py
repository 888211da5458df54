"""The scenarios of a run, each measured on every path, interleaved.

Two shapes of stream load: in (b) each stream's events come at its own
phase (streams start spread over a ramp, and each event is its own upstream
write and read); in (g) every stream's events come in the upstream's one
shared decode step, as a batching engine emits them.

Interleaving: a scenario runs in rounds, and each round visits every path
once, in an order rotated from round to round, so slow drift of the
machine (other work, thermal state) lands on all paths alike. The direct
path is measured in every round too: added latency is always a path's
percentile minus the direct path's percentile from the same scenario of the
same run.

Every load loop is bounded: streams carry a fixed number of events, each
window has a fixed length, each client process a timeout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import procfs
from bench.paths import (
    HOST,
    REPO,
    Running,
    _child_env,
    await_path,
    launch_path,
    start_path,
    start_upstream,
)
from bench.stats import added, percentiles, ratio

__all__ = ["ALIGNED_PATHS", "FULL", "QUICK", "Bench", "Plan"]

CHAT_PATH = "/v1/chat/completions"

#: The paths scenario (g) loads: the baseline, the sidecars, and nginx to compare with.
ALIGNED_PATHS = ("direct", "sidecar", "sidecar-uvloop", "nginx")


@dataclass(frozen=True)
class Plan:
    """How much of everything a run does."""

    name: str
    #: Scenario (a): one stream at this rate, this long per window, this many rounds.
    single_tps: float
    single_s: float
    single_rounds: int
    #: Scenario (b) and the plot: concurrent streams at ``sweep_tps`` each.
    levels: tuple[int, ...]
    sweep_tps: float
    measure_s: float
    #: Levels measured in more than one round (the ones with targets).
    key_levels: tuple[int, ...]
    key_rounds: int
    #: Scenario (c): further levels for the paths still standing.
    max_levels: tuple[int, ...]
    #: Scenario (c): bisection steps between the sweep's levels, per sidecar.
    refine_steps: int
    #: Scenario (g): concurrent streams at ``sweep_tps`` each, all in one decode step.
    aligned_levels: tuple[int, ...]
    aligned_rounds: int
    #: Scenario (d): idle stream counts per proxy (each in a fresh proxy if asked).
    idle_counts: tuple[int, ...]
    fresh_for_idle: bool
    #: Scenarios (e) and (f): samples per path.
    cancel_samples: int
    ttft_samples: int
    #: How long a path gets to close its upstream before the close counts as never.
    cancel_wait_s: float = 1.0
    #: Scenario (d): idle streams opened and closed before the baseline RSS is read.
    idle_warmup: int = 50
    #: Scenario (d): seconds between the last stream opening and the RSS reading.
    idle_settle_s: float = 1.0
    #: Seconds between a client process's launch and its first stream.
    start_delay_s: float = 0.4
    settle_s: float = 0.25
    #: Streams opened per second during a window's ramp.
    open_rate: float = 1000.0


QUICK = Plan(
    name="quick",
    single_tps=50,
    single_s=0.6,
    single_rounds=1,
    levels=(50,),
    sweep_tps=20,
    measure_s=0.6,
    key_levels=(),
    key_rounds=1,
    max_levels=(),
    refine_steps=0,
    aligned_levels=(50,),
    aligned_rounds=1,
    idle_counts=(50, 100),
    fresh_for_idle=False,
    cancel_samples=5,
    ttft_samples=5,
    cancel_wait_s=0.3,
    idle_warmup=0,
    idle_settle_s=0.3,
    start_delay_s=0.3,
    settle_s=0.1,
)

FULL = Plan(
    name="full",
    single_tps=50,
    single_s=5.0,
    single_rounds=2,
    levels=(10, 200, 500, 1000, 2000),
    sweep_tps=20,
    measure_s=3.0,
    key_levels=(200, 500, 1000),
    key_rounds=2,
    max_levels=(2500, 3000, 4000),
    refine_steps=3,
    aligned_levels=(500, 1000),
    aligned_rounds=2,
    # 1,000: issue 11's figure; 10,000: issue 7's (capped by the descriptor limit).
    idle_counts=(1000, 10_000),
    fresh_for_idle=True,
    cancel_samples=200,
    ttft_samples=100,
)


@dataclass
class Cell:
    """Everything measured for one path at one load level, over all rounds."""

    samples: array[int] = field(default_factory=lambda: array("q"))
    ttfts: list[int] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)


class Bench:
    """One benchmark run: the processes, the scenarios, the raw results."""

    def __init__(self, plan: Plan, paths: list[str], log: Any = None) -> None:
        self.plan = plan
        self.wanted = paths
        self.workdir = Path(tempfile.mkdtemp(prefix="streamwarden-bench-"))
        self.upstream: Running | None = None
        self.paths: dict[str, Running] = {}
        self.unavailable: dict[str, str] = {}
        self.results: dict[str, Any] = {}
        self._log = log or (lambda message: print(message, file=sys.stderr, flush=True))

    def log(self, message: str) -> None:
        self._log(message)

    # -- processes -----------------------------------------------------------

    def start(self) -> None:
        self.upstream = start_upstream(self.workdir)
        launched: list[Running] = []
        for name in self.wanted:
            try:
                launched.append(launch_path(name, self.upstream, self.workdir))
            except (RuntimeError, OSError) as exc:
                self._unavailable(name, exc)
        for running in launched:
            try:
                self.paths[running.name] = await_path(running)
            except (RuntimeError, OSError) as exc:
                self._unavailable(running.name, exc)

    def _unavailable(self, name: str, exc: Exception) -> None:
        lines = str(exc).strip().splitlines()
        # The first line says which path; the last one usually says why.
        self.unavailable[name] = lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1]}"
        self.log(f"  {name}: unavailable: {self.unavailable[name]}")

    def _start(self, name: str) -> None:
        assert self.upstream is not None
        try:
            self.paths[name] = start_path(name, self.upstream, self.workdir)
        except (RuntimeError, OSError) as exc:
            self._unavailable(name, exc)

    def restart(self, name: str) -> None:
        running = self.paths.pop(name, None)
        if running is not None:
            running.stop()
        self._start(name)

    def stop(self) -> None:
        for running in self.paths.values():
            running.stop()
        if self.upstream is not None:
            self.upstream.stop()

    def live(self) -> list[str]:
        """The started paths, in the order asked for, that are still running."""
        out = []
        for name in self.wanted:
            running = self.paths.get(name)
            if running is None:
                continue
            if not running.alive():
                self.unavailable.setdefault(name, "exited during the run")
                continue
            out.append(name)
        return out

    # -- the client ----------------------------------------------------------

    def _client(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "bench.client", json.dumps(spec)],
            capture_output=True,
            cwd=REPO,
            env=_child_env(),
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0 or not done.stdout.strip():
            raise RuntimeError(f"client failed: {done.stderr.decode(errors='replace')[-1500:]}")
        result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
        return result

    def stream_window(
        self, name: str, streams: int, tps: float, measure_s: float, align: bool = False
    ) -> Cell:
        """One measured window of ``streams`` streams at ``tps`` through one path.

        ``align``: every stream's events in the upstream's shared decode
        step, instead of each stream at its own phase.
        """
        plan = self.plan
        running = self.paths[name]
        assert self.upstream is not None
        ramp = max(0.2, streams / plan.open_rate)
        events = math.ceil(tps * (ramp + plan.settle_s + measure_s + 2.0))
        samples_file = self.workdir / f"samples-{name}.bin"
        spec = {
            "mode": "stream",
            "host": HOST,
            "port": running.port,
            "path": CHAT_PATH,
            "streams": streams,
            "tps": tps,
            "events": events,
            "start_ns": time.monotonic_ns() + int(plan.start_delay_s * 1e9),
            "ramp_s": ramp,
            "settle_s": plan.settle_s,
            "measure_s": measure_s,
            "align": align,
            "samples": str(samples_file),
            "cpu_pids": {"proxy": running.measured, "upstream": self.upstream.measured},
            "machine": True,
        }
        timeout = plan.start_delay_s + ramp + plan.settle_s + measure_s + 30.0
        result = self._client(spec, timeout)
        quiet_after = self._quiesce(running.measured + self.upstream.measured)
        cell = Cell()
        cell.samples.frombytes(samples_file.read_bytes())
        cell.ttfts.extend(result.pop("ttft_ns"))
        window = result["window_s"]
        cpu = result["cpu_s"]
        events_in_window = result["window_events"]
        offered = streams * tps
        proxy_cpu = cpu.get("proxy")
        ours = sum(v for k, v in cpu.items() if k != "machine" and v is not None)
        summary = {
            "streams": streams,
            "tps": tps,
            "aligned": align,
            "offered_events_per_s": round(offered, 1),
            "delivered_events_per_s": round(events_in_window / window, 1),
            "opened": result["opened"],
            "failed": result["failed"],
            "broken": result["broken"],
            "cpu_util": {
                k: round(v / window, 3) for k, v in cpu.items() if v is not None and k != "machine"
            },
            # CPU the rest of the machine used meanwhile (other jobs): noise.
            "other_cpu_util": round(max(0.0, cpu.get("machine", ours) - ours) / window, 3),
            "proxy_cpu_us_per_event": round(proxy_cpu / events_in_window * 1e6, 2)
            if proxy_cpu is not None and events_in_window and running.measured
            else None,
            "client_loop_lag_ms": result["loop_lag_ms"],
            "quiesce_s": quiet_after,
        }
        cell.windows.append(summary)
        return cell

    @staticmethod
    def _quiesce(pids: list[int], limit_s: float = 10.0) -> float:
        """Wait until these processes are idle again; return how long that took.

        A proxy that fell behind still works through its backlog (and the
        cancellations) after the client has gone; the next window, on
        another path, must not share the machine with it.
        """
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            before = procfs.cpu_seconds(pids)
            time.sleep(0.1)
            if procfs.cpu_seconds(pids) - before < 0.01:  # under 10% of a core
                break
        return round(time.monotonic() - started, 2)

    # -- scenarios -----------------------------------------------------------

    def rounds(self, count: int) -> list[list[str]]:
        """The path order of each round, rotated so no path is always first or last."""
        names = self.live()
        out = []
        for r in range(count):
            shift = r % max(1, len(names))
            out.append(names[shift:] + names[:shift])
        return out

    def load_level(
        self,
        streams: int,
        tps: float,
        measure_s: float,
        rounds: int,
        paths: list[str],
        align: bool = False,
    ) -> dict[str, Any]:
        cells: dict[str, Cell] = {name: Cell() for name in paths}
        for order in self.rounds(rounds):
            for name in order:
                if name not in cells:
                    continue
                try:
                    cell = self.stream_window(name, streams, tps, measure_s, align)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    self.log(f"  {name}: window failed: {exc}")
                    cells[name].windows.append({"error": str(exc)[:500]})
                    continue
                merged = cells[name]
                merged.samples.extend(cell.samples)
                merged.ttfts.extend(cell.ttfts)
                merged.windows.extend(cell.windows)
                w = cell.windows[0]
                p = percentiles(sorted(cell.samples))
                self.log(
                    f"  {streams:>5} x {tps:g}/s{' aligned' if align else ''} {name:<15} "
                    f"p50 {p['p50']} ms p99 {p['p99']} ms "
                    f"rate {w['delivered_events_per_s']:.0f}/{w['offered_events_per_s']:.0f} "
                    f"cpu/event {w['proxy_cpu_us_per_event']} us util {w['cpu_util']} "
                    f"other {w['other_cpu_util']}"
                )
        return {name: summarize_cell(cell) for name, cell in cells.items()}

    def single_stream(self) -> None:
        plan = self.plan
        self.log(f"(a) one stream at {plan.single_tps:g} events/s")
        per_path = self.load_level(
            1, plan.single_tps, plan.single_s, plan.single_rounds, self.live()
        )
        compare(per_path)
        self.results["a_single_stream"] = {"tps": plan.single_tps, "per_path": per_path}

    def sweep(self) -> None:
        plan = self.plan
        levels_out = []
        standing = self.live()
        for streams in plan.levels + plan.max_levels:
            extra = streams in plan.max_levels
            # Levels with targets measure every path, keeping up or not.
            candidates = self.live() if streams in plan.key_levels else standing
            paths = [
                p
                for p in candidates
                if p in self.live()
                and (not extra or p in ("direct", "sidecar", "sidecar-uvloop", "nginx"))
            ]
            if not [p for p in paths if p not in ("direct", "nginx")]:
                break  # no sidecar left standing: nothing more for (c) to find
            self.log(f"(b/c) {streams} streams at {plan.sweep_tps:g} events/s")
            rounds = plan.key_rounds if streams in plan.key_levels else 1
            per_path = self.load_level(streams, plan.sweep_tps, plan.measure_s, rounds, paths)
            compare(per_path)
            levels_out.append(
                {"streams": streams, "tps": plan.sweep_tps, "rounds": rounds, "per_path": per_path}
            )
            # A path that could not keep up is not loaded further: it would only
            # take the machine from the others.
            standing = [
                p for p in standing if p == "direct" or not per_path.get(p, {}).get("overloaded")
            ]
        self.results["b_concurrency"] = {"tps": plan.sweep_tps, "levels": levels_out}
        rates = max_rates(levels_out)
        for name in ("sidecar", "sidecar-uvloop"):
            if name in rates["per_path"] and plan.refine_steps:
                self._refine(name, rates["per_path"][name])
        self.results["c_max_rate"] = rates

    def _refine(self, name: str, record: dict[str, Any]) -> None:
        """Narrow a sidecar's sustained rate between the sweep's levels, by bisection.

        The sweep's levels are far apart; each step here loads the path and
        the direct baseline, interleaved, at the geometric middle of the
        last level that passed and the first that did not.
        """
        plan = self.plan
        miss = record.get("first_miss")
        if miss is None or name not in self.live():
            return
        low, high = max(1, record["streams"]), miss["streams"]
        steps = []
        for _ in range(plan.refine_steps):
            if high <= low * 1.15:
                break
            middle = max(low + 1, round((low * high) ** 0.5 / 10) * 10)
            if middle >= high:
                break
            self.log(f"(c) {name}: {middle} streams")
            per_path = self.load_level(middle, plan.sweep_tps, plan.measure_s, 1, ["direct", name])
            compare(per_path)
            entry = per_path[name]
            p99_added = entry["added_ms"]["p99"]
            ok = (
                bool(entry.get("kept_up"))
                and p99_added is not None
                and p99_added < MAX_ADDED_P99_MS
            )
            steps.append(
                {
                    "streams": middle,
                    "events_per_s": middle * plan.sweep_tps,
                    "p99_added_ms": p99_added,
                    "delivered_events_per_s": entry.get("delivered_events_per_s"),
                    "sustained": ok,
                }
            )
            if ok:
                low = middle
                record.update(
                    sustained_events_per_s=middle * plan.sweep_tps,
                    streams=middle,
                    p99_added_ms=p99_added,
                    proxy_cpu_util=(entry["windows"][0].get("cpu_util") or {}).get("proxy"),
                )
            else:
                high = middle
        record["refined"] = steps

    def aligned(self) -> None:
        """Scenario (g): the streams' events all in one decode step, at each aligned level."""
        plan = self.plan
        levels_out = []
        for streams in plan.aligned_levels:
            paths = [p for p in self.live() if p in ALIGNED_PATHS]
            if not [p for p in paths if p != "direct"]:
                break
            self.log(f"(g) {streams} streams at {plan.sweep_tps:g} events/s, one decode step")
            per_path = self.load_level(
                streams, plan.sweep_tps, plan.measure_s, plan.aligned_rounds, paths, align=True
            )
            compare(per_path)
            levels_out.append(
                {
                    "streams": streams,
                    "tps": plan.sweep_tps,
                    "rounds": plan.aligned_rounds,
                    "per_path": per_path,
                }
            )
        self.results["g_aligned"] = {"tps": plan.sweep_tps, "levels": levels_out}

    def cancel(self) -> None:
        plan = self.plan
        assert self.upstream is not None
        names = self.live()
        self.log(f"(e) cancel propagation, {plan.cancel_samples} samples per path")
        spec = {
            "mode": "cancel",
            "host": HOST,
            "targets": {name: self.paths[name].port for name in names},
            "upstream_port": self.upstream.port,
            "path": CHAT_PATH,
            "samples": plan.cancel_samples,
            "tag": f"c{time.monotonic_ns()}",
            "wait_s": plan.cancel_wait_s,
        }
        timeout = plan.cancel_samples * len(names) * 0.5 + 60
        result = self._client(spec, timeout)
        per_path: dict[str, Any] = {}
        for name in names:
            delays = sorted(result["delays_ns"][name])
            per_path[name] = {
                "ms": percentiles(delays),
                "missing": result["missing"][name],
                "errors": result["errors"][name],
            }
        base = per_path.get("direct", {}).get("ms", {})
        nginx = per_path.get("nginx", {}).get("ms", {})
        for name, entry in per_path.items():
            entry["added_ms"] = added(entry["ms"], base)
            entry["ratio_vs_nginx"] = {
                k: ratio(entry["ms"].get(k), nginx.get(k)) for k in ("p50", "p99")
            }
            self.log(f"  {name:<15} {entry['ms']} missing {entry['missing']}")
        self.results["e_cancel"] = {"samples": plan.cancel_samples, "per_path": per_path}

    def ttft(self) -> None:
        plan = self.plan
        names = self.live()
        self.log(f"(f) TTFT overhead, {plan.ttft_samples} samples per path and kind")
        spec = {
            "mode": "ttft",
            "host": HOST,
            "targets": {name: self.paths[name].port for name in names},
            "path": CHAT_PATH,
            "samples": plan.ttft_samples,
        }
        result = self._client(spec, plan.ttft_samples * len(names) * 0.5 + 60)
        per_path: dict[str, Any] = {}
        for name in names:
            per_path[name] = {
                "streamed_ms": percentiles(sorted(result["streamed_ns"][name])),
                "whole_ms": percentiles(sorted(result["whole_ns"][name])),
                "errors": result["errors"][name],
            }
        base = per_path.get("direct")
        for name, entry in per_path.items():
            if base is not None:
                entry["streamed_overhead_ms"] = added(entry["streamed_ms"], base["streamed_ms"])
                entry["whole_overhead_ms"] = added(entry["whole_ms"], base["whole_ms"])
            self.log(
                f"  {name:<15} streamed p50 {entry['streamed_ms']['p50']} ms, "
                f"non-streamed p50 {entry['whole_ms']['p50']} ms"
            )
        self.results["f_ttft"] = {"samples": plan.ttft_samples, "per_path": per_path}

    def idle_memory(self) -> None:
        plan = self.plan
        # A proxied stream holds two sockets in the proxy (client side and
        # upstream side), and the descriptor limit may not be raisable (here:
        # no CAP_SYS_RESOURCE, hard limit 20,000), so the plan's count is
        # capped to what one process can hold, with room for its other files.
        fd_limit = procfs.raise_fd_limit()
        counts = []
        for planned in plan.idle_counts:
            count = min(planned, (fd_limit - 200) // 2)
            if count < planned:
                self.log(f"(d) {planned} idle streams need more descriptors than {fd_limit}")
            self.log(f"(d) {count} idle streams per proxy")
            per_path: dict[str, Any] = {}
            for name in [n for n in self.live() if n != "direct"]:
                if plan.fresh_for_idle:
                    # A fresh process: a heap that already grew in earlier scenarios
                    # would hide the new streams' memory in its free lists.
                    self.restart(name)
                    if name not in self.paths:
                        continue
                try:
                    if plan.idle_warmup:
                        self._idle(name, plan.idle_warmup)  # imports, pools, caches warmed up
                    per_path[name] = self._idle(name, count)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    self.log(f"  {name}: idle run failed: {exc}")
                    per_path[name] = {"error": str(exc)[:500]}
                    continue
                self.log(f"  {name:<15} {per_path[name]}")
            nginx = per_path.get("nginx", {}).get("kib_per_stream")
            for entry in per_path.values():
                if "kib_per_stream" in entry:
                    entry["ratio_vs_nginx"] = ratio(entry["kib_per_stream"], nginx)
            counts.append({"streams": count, "planned_streams": planned, "per_path": per_path})
        # The largest count's figures at the top level, where earlier runs had them.
        largest = counts[-1]
        self.results["d_idle_memory"] = {
            "streams": largest["streams"],
            "planned_streams": largest["planned_streams"],
            "fd_limit": fd_limit,
            "per_path": largest["per_path"],
            "counts": counts,
        }

    def _idle(self, name: str, count: int) -> dict[str, Any]:
        running = self.paths[name]
        time.sleep(min(0.3, self.plan.idle_settle_s))
        before = procfs.rss_kib(running.measured)
        spec = {
            "mode": "idle",
            "host": HOST,
            "port": running.port,
            "path": CHAT_PATH,
            "streams": count,
            "open_timeout_s": 120.0,
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.client", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            env=_child_env(),
        )
        assert process.stdin is not None and process.stdout is not None
        try:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(
                    process.stderr.read().decode(errors="replace")[-1500:]
                    if process.stderr
                    else "client died"
                )
            opened = json.loads(line)
            # Let the proxy finish its bookkeeping for the last streams.
            time.sleep(self.plan.idle_settle_s)
            during = procfs.rss_kib(running.measured)
            process.stdin.write(b"close\n")
            process.stdin.flush()
            process.wait(60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        n = opened["opened"]
        return {
            "requested": count,
            "opened": n,
            "open_s": opened["open_s"],
            "open_errors": opened.get("errors", {}),
            "rss_before_kib": before,
            "rss_open_kib": during,
            "kib_per_stream": round((during - before) / n, 2) if n else None,
        }

    def run(self) -> dict[str, Any]:
        started = time.time()
        self.start()
        try:
            self.ttft()
            self.cancel()
            self.single_stream()
            self.sweep()
            self.aligned()
            self.idle_memory()
        finally:
            self.stop()
        self.results["duration_s"] = round(time.time() - started, 1)
        return self.results


def summarize_cell(cell: Cell) -> dict[str, Any]:
    ordered = sorted(cell.samples)
    windows = [w for w in cell.windows if "error" not in w]
    out: dict[str, Any] = {"latency_ms": percentiles(ordered), "windows": cell.windows}
    if cell.ttfts:
        out["stream_ttft_ms"] = percentiles(sorted(cell.ttfts))
    if windows:
        offered = windows[0]["offered_events_per_s"]
        delivered = min(w["delivered_events_per_s"] for w in windows)
        cpu = [w["proxy_cpu_us_per_event"] for w in windows if w["proxy_cpu_us_per_event"]]
        out["offered_events_per_s"] = offered
        out["delivered_events_per_s"] = delivered
        out["proxy_cpu_us_per_event"] = round(sum(cpu) / len(cpu), 2) if cpu else None
        failures = sum(w["failed"] + w["broken"] for w in windows)
        opened = min(w["opened"] for w in windows)
        streams = windows[0]["streams"]
        p99 = out["latency_ms"]["p99"]
        out["failures"] = failures
        out["kept_up"] = delivered >= 0.97 * offered and failures == 0 and opened >= streams
        out["overloaded"] = (
            delivered < 0.9 * offered or opened < 0.95 * streams or (p99 is not None and p99 > 200)
        )
    else:
        out["kept_up"] = False
        out["overloaded"] = True
    return out


def compare(per_path: dict[str, Any]) -> None:
    """Add each path's latency over direct, and its ratios to direct and to nginx."""
    base = per_path.get("direct", {}).get("latency_ms", {})
    nginx = per_path.get("nginx", {})
    nginx_lat = nginx.get("latency_ms", {})
    for entry in per_path.values():
        lat = entry["latency_ms"]
        entry["added_ms"] = added(lat, base)
        entry["ratio_vs_direct"] = {k: ratio(lat.get(k), base.get(k)) for k in ("p50", "p99")}
        entry["ratio_vs_nginx"] = {k: ratio(lat.get(k), nginx_lat.get(k)) for k in ("p50", "p99")}
        entry["cpu_ratio_vs_nginx"] = ratio(
            entry.get("proxy_cpu_us_per_event"), nginx.get("proxy_cpu_us_per_event")
        )


#: Scenario (c)'s criterion: p99 added latency under this, and every event delivered.
MAX_ADDED_P99_MS = 5.0


def max_rates(levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path, the highest aggregate event rate it sustained within the criterion."""
    best: dict[str, Any] = {}
    for level in levels:
        direct = level["per_path"].get("direct", {})
        for name, entry in level["per_path"].items():
            rate = entry.get("offered_events_per_s", 0)
            p99_added = entry.get("added_ms", {}).get("p99")
            ok = entry.get("kept_up") and (
                name == "direct" or (p99_added is not None and p99_added < MAX_ADDED_P99_MS)
            )
            record = best.setdefault(
                name, {"sustained_events_per_s": 0, "streams": 0, "first_miss": None}
            )
            if ok and rate > record["sustained_events_per_s"]:
                record.update(
                    sustained_events_per_s=rate,
                    streams=level["streams"],
                    p99_added_ms=p99_added,
                    proxy_cpu_util=(entry["windows"][0].get("cpu_util") or {}).get("proxy"),
                )
            elif not ok and record["first_miss"] is None:
                record["first_miss"] = {
                    "streams": level["streams"],
                    "events_per_s": rate,
                    "delivered_events_per_s": entry.get("delivered_events_per_s"),
                    "p99_added_ms": p99_added,
                    # Whether the harness itself kept up at this level.
                    "direct_kept_up": bool(direct.get("kept_up")),
                }
    return {
        "criterion": f"all events delivered, p99 added < {MAX_ADDED_P99_MS:g} ms",
        "per_path": best,
    }
