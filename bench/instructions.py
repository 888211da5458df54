"""The sidecar's own instructions per event, counted by callgrind under a light load.

``python -m bench.instructions`` starts the bench upstream, the sidecar
(uvloop) under ``valgrind --tool=callgrind --instr-atstart=no`` and the
bench client (streams each at its own phase), switches instrumentation on
for ``--seconds`` once every stream streams, and reads the profile: the
instructions the sidecar's process ran in that window per event relayed,
and the functions that ran most of them (self cost). Instruction counts do
not depend on what else the machine runs, so two builds compare on a busy
machine too; they leave out the kernel (about half the CPU per event) and
the cost of cache misses.

Events are counted as calls of the compiled ``Relay.feed`` (one per
upstream read, which at this load is one event): the compiled build only.

    python -m bench.instructions                  # 40 streams x 20/s, 20 s counted
    python -m bench.instructions --top 40 --json bench/results/instructions.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.paths import HOST, REPO, free_port, start_upstream, wait_http

_FEED = "CPyDef_relay___Relay___feed"
_NAME = re.compile(r"\((\d+)\)(?: (.*))?")


def read_profile(path: Path) -> tuple[collections.Counter[str], int]:
    """Self cost per function, and the calls of ``Relay.feed``, from a callgrind out file."""
    names: dict[str, str] = {}

    def name(token: str) -> str:
        match = _NAME.match(token)
        if match is None:
            return token
        if match.group(2):
            names[match.group(1)] = match.group(2)
        return names.get(match.group(1), token)

    own: collections.Counter[str] = collections.Counter()
    feeds = 0
    function = callee = ""
    calls: int | None = None
    with path.open() as lines:
        for line in lines:
            if line.startswith("fn="):
                function = name(line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                callee = name(line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                calls = int(line[6:].split()[0])
            elif line[:1].isdigit() or line[:1] in "+-*":
                if calls is not None:  # the cost line of a call: inclusive, not this one's
                    if callee == _FEED:
                        feeds += calls
                    calls = None
                else:
                    parts = line.split()
                    if len(parts) > 1:
                        own[function] += int(parts[1])
    return own, feeds


RAMP_S = 2.0
SETTLE_S = 3.0


def _under_callgrind(work: Path, upstream_port: int, port: int, admin: int) -> list[str]:
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={work}/out.%p",
        sys.executable,
        "-m",
        "streamwarden.cli",
        "run",
        "--upstream",
        f"http://{HOST}:{upstream_port}",
        "--listen",
        f"{HOST}:{port}",
        "--admin-listen",
        f"{HOST}:{admin}",
        "--uvloop",
    ]


def client_spec(
    port: int, streams: int, tps: float, seconds: float, work: Path, start_ns: int
) -> dict[str, object]:
    """The bench client's load: each stream at its own phase, long enough for the count.

    Every stream is open and streaming ``RAMP_S + SETTLE_S`` after ``start_ns``.
    """
    return {
        "mode": "stream",
        "host": HOST,
        "port": port,
        "path": "/v1/chat/completions",
        "streams": streams,
        "tps": tps,
        "events": int(tps * (seconds + 30)),
        "start_ns": start_ns,
        "ramp_s": RAMP_S,
        "settle_s": SETTLE_S,
        "measure_s": seconds + 10,
        "align": False,
        "samples": str(work / "samples.bin"),
        "cpu_pids": {},
        "machine": False,
    }


def _control(*args: object) -> None:
    command = ["callgrind_control", *map(str, args)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(streams: int, tps: float, seconds: float, top: int) -> dict[str, object]:
    port, admin = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    work = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    upstream = start_upstream(work)
    children: list[subprocess.Popen[bytes]] = []
    try:
        sidecar = subprocess.Popen(
            _under_callgrind(work, upstream.port, port, admin),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        children.append(sidecar)
        wait_http(admin, "/healthz", 300)  # valgrind takes its time to start Python
        start_ns = time.monotonic_ns() + 2_000_000_000
        spec = client_spec(port, streams, tps, seconds, work, start_ns)
        client = subprocess.Popen(
            [sys.executable, "-m", "bench.client", json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        children.append(client)
        # The client's load runs on a clock (its start, ramp and settle): the
        # count starts a second after every stream is open and streaming.
        counted_from = start_ns + int((RAMP_S + SETTLE_S + 1) * 1e9)
        time.sleep(max(0.0, (counted_from - time.monotonic_ns()) / 1e9))
        _control("-i", "on", sidecar.pid)
        time.sleep(seconds)  # the counted window itself
        _control("-i", "off", sidecar.pid)
        _control("-d", sidecar.pid)
        client.communicate(timeout=seconds + 120)
        dumps = sorted(work.glob("out.*"), key=lambda p: p.stat().st_size)
        own, feeds = read_profile(dumps[-1])
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        upstream.stop()
    if not feeds:
        raise RuntimeError("no Relay.feed calls counted: is the build compiled?")
    return {
        "streams": streams,
        "tps": tps,
        "seconds": seconds,
        "events": feeds,
        "instructions_per_event": round(sum(own.values()) / feeds),
        "top": [[fn, round(cost / feeds)] for fn, cost in own.most_common(top)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--tps", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("python -m bench.instructions needs valgrind (apt-get install valgrind)")
    result = measure(args.streams, args.tps, args.seconds, args.top)
    print(f"{result['events']} events, {result['instructions_per_event']} instructions per event")
    for fn, cost in result["top"]:  # type: ignore[attr-defined]
        print(f"{cost:8d}  {fn}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
