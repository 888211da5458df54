"""``python -m bench profile``: where a proxy's CPU goes under a steady stream load.

Starts the upstream and one path, runs one load window through it, and
samples the path's process with py-spy (``pip install py-spy``; root or
``ptrace`` rights needed) for the measured part of the window only, so
connection setup during the ramp is left out. Writes py-spy's collapsed
stacks (open them in speedscope or ``flamegraph.pl``) and prints the
functions with the most samples, by self time and by inclusive time.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.paths import HOST, REPO
from bench.scenarios import FULL, Bench

_LINE = re.compile(r" \(([^)]*?)(?::\d+)?\)$")


def _function(frame: str) -> str:
    """``name (path/file.py:123)`` → ``name (file.py)``: one entry per function, not per line."""
    match = _LINE.search(frame)
    if not match:
        return frame
    name = frame[: match.start()]
    where = match.group(1).rsplit("/", 2)
    return f"{name} ({'/'.join(where[-2:])})"


def summarize(collapsed: Path, top: int = 30) -> str:
    self_counts: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(f) for f in stack.split(";")[1:]]  # [0] is the process
        if not frames:
            continue
        total += count
        self_counts[frames[-1]] += count
        for name in set(frames):
            inclusive[name] += count
    if not total:
        return "no samples"
    lines = [f"{total} samples", "", "self %  function"]
    lines += [f"{n * 100 / total:6.1f}  {name}" for name, n in self_counts.most_common(top)]
    lines += ["", "total %  function"]
    lines += [f"{n * 100 / total:7.1f}  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


def profile(
    path: str,
    streams: int,
    tps: float,
    seconds: float,
    out: Path | None,
    requests: int = 0,
    align: bool = False,
    native: bool = False,
) -> int:
    """Profile ``path`` under a stream load, or under ``requests`` sequential requests if > 0.

    ``align``: the streams' events in one decode step (scenario g's shape)
    instead of each stream at its own phase (scenario b's). ``native``: C
    frames too (py-spy ``--native``; it stops the process for each sample,
    so the window's CPU figures are inflated).
    """
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if path in ("nginx",) or not Path(spy).exists():
        print("py-spy is needed (pip install py-spy), and the path must be a Python one")
        return 2
    label = f"{requests}-requests" if requests else f"{streams}x{tps:g}"
    if align and not requests:
        label += "-aligned"
    if native:
        label += "-native"
    out = out or REPO / "bench" / "results" / "profiles" / f"{path}-{label}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    bench = Bench(FULL, ["direct", path])
    bench.start()
    try:
        running = bench.paths[path]
        plan = bench.plan
        ramp = max(0.2, streams / plan.open_rate)
        delay = 0.3 if requests else plan.start_delay_s + ramp + plan.settle_s
        command = [
            spy,
            "record",
            "--pid",
            str(running.measured[0]),
            "--duration",
            str(int(seconds)),
            "--rate",
            "250",
            "--format",
            "raw",
            *(["--native"] if native else ["--nonblocking"]),
            "--output",
            str(out),
        ]
        spies: list[subprocess.Popen[bytes]] = []
        timer = threading.Timer(
            delay,
            lambda: spies.append(
                subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            ),
        )
        timer.start()
        if requests:
            # TTFT's exchange (new connection, streamed then non-streamed request)
            # on a loop, for the per-request cost rather than the per-event one.
            spec = {
                "mode": "ttft",
                "host": HOST,
                "targets": {path: running.port},
                "path": "/v1/chat/completions",
                "samples": requests,
                "gap_s": 0.0,
            }
            summary: object = bench._client(spec, seconds + 120)
        else:
            summary = bench.stream_window(path, streams, tps, seconds + 1.0, align).windows[0]
        timer.join()
        for spy_process in spies:
            _, err = spy_process.communicate(timeout=seconds + 30)
            if spy_process.returncode:
                print(err.decode(errors="replace")[-1000:])
        if not requests:
            print(f"window: {summary}")
    finally:
        bench.stop()
    time.sleep(0.1)
    if out.exists():
        print(summarize(out))
        print(f"\ncollapsed stacks: {out}")
    return 0


def memory_profile(streams: int, top: int = 25) -> int:
    """Python allocations per idle stream in an in-process sidecar, by allocating line.

    tracemalloc sees Python's own allocations only (not the kernel's socket
    buffers, nor C libraries' mallocs), which is most of what grows per
    stream; the RSS figure of scenario (d) is the ground truth.
    """
    import asyncio
    import gc
    import json
    import tracemalloc

    from bench.paths import HOST, _child_env, start_upstream
    from streamwarden.config import load_settings
    from streamwarden.sidecar import Sidecar

    workdir = Path(tempfile.mkdtemp(prefix="streamwarden-memprofile-"))
    upstream = start_upstream(workdir)

    async def main() -> None:
        settings = load_settings(
            environ={},
            overrides={
                "upstream": f"http://{HOST}:{upstream.port}",
                "listen": f"{HOST}:0",
                "admin_listen": f"{HOST}:0",
                "log_level": "warning",
            },
        )
        sidecar = Sidecar(settings)
        await sidecar.start()
        spec = {
            "mode": "idle",
            "host": HOST,
            "port": sidecar.proxy_port,
            "path": "/v1/chat/completions",
            "streams": streams,
        }
        for phase in ("warm", "measure"):
            client = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.client",
                json.dumps(spec if phase == "measure" else {**spec, "streams": 20}),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=REPO,
                env=_child_env(),
            )
            assert client.stdout is not None and client.stdin is not None
            if phase == "measure":
                gc.collect()
                before = tracemalloc.take_snapshot()
            opened = json.loads(await client.stdout.readline())
            await asyncio.sleep(0.5)
            if phase == "measure":
                gc.collect()
                after = tracemalloc.take_snapshot()
            client.stdin.write(b"close\n")
            await client.stdin.drain()
            await client.wait()
            await asyncio.sleep(0.3)
        await sidecar.close()
        n = opened["opened"] or 1
        stats = after.compare_to(before, "lineno")
        grown = sum(s.size_diff for s in stats)
        print(f"{opened['opened']} idle streams: {grown / n / 1024:.1f} KiB of Python heap each")
        print("KiB/stream  objects/stream  where")
        for stat in stats[:top]:
            frame = stat.traceback[0]
            where = "/".join(frame.filename.rsplit("/", 2)[-2:]) + f":{frame.lineno}"
            print(f"{stat.size_diff / n / 1024:9.2f}  {stat.count_diff / n:14.1f}  {where}")
        print("\nby file:")
        for stat in after.compare_to(before, "filename")[:12]:
            where = "/".join(stat.traceback[0].filename.rsplit("/", 2)[-2:])
            print(f"{stat.size_diff / n / 1024:9.2f}  {stat.count_diff / n:14.1f}  {where}")

    tracemalloc.start(1)
    try:
        asyncio.run(main())
    finally:
        upstream.stop()
    return 0
