"""What the harness reads about a process from /proc, and how its children start.

CPU time comes from ``/proc/PID/task/*/schedstat`` (nanoseconds of run
time, summed over threads), falling back to ``/proc/PID/stat`` (clock
ticks); resident memory from ``VmRSS`` in ``/proc/PID/status``. Linux only,
which is where the harness runs.
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "children",
    "cpu_seconds",
    "machine_busy_seconds",
    "raise_fd_limit",
    "rss_kib",
    "run",
]

_TICKS = os.sysconf("SC_CLK_TCK")

#: Descriptors each harness process asks for: 10,000 proxied streams need
#: 20,000 sockets in the proxy alone.
FD_LIMIT = 65536


def raise_fd_limit(wanted: int = FD_LIMIT) -> int:
    """Raise RLIMIT_NOFILE as far as allowed (root may raise the hard limit too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in ((wanted, max(hard, wanted)), (min(wanted, hard), hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, target)
            return target[0]
        except (ValueError, OSError):
            continue
    return soft


def run(main: Coroutine[Any, Any, Any], *, uvloop: bool = True) -> Any:
    """Run ``main`` on uvloop when asked and installed, else on asyncio's own loop."""
    if uvloop:
        try:
            import uvloop as _uvloop
        except ImportError:
            pass
        else:
            return _uvloop.run(main)
    return asyncio.run(main)


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by these processes, all threads."""
    total = 0.0
    for pid in pids:
        total += _cpu_of(pid)
    return total


def _cpu_of(pid: int) -> float:
    tasks = Path(f"/proc/{pid}/task")
    try:
        seconds = 0.0
        for task in tasks.iterdir():
            seconds += int((task / "schedstat").read_text().split()[0]) / 1e9
        return seconds
    except (OSError, ValueError, IndexError):
        pass
    try:
        user, system = _user_system_ticks(pid)
    except OSError:
        return 0.0
    return (user + system) / _TICKS


def _user_system_ticks(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of the whole line, 12 and 13 after ")".
    return int(fields[11]), int(fields[12])


def user_system_seconds(pids: Iterable[int]) -> tuple[float, float]:
    """CPU seconds these processes spent in user space and in the kernel (clock-tick resolution)."""
    user = system = 0
    for pid in pids:
        ticks = _user_system_ticks(pid)
        user += ticks[0]
        system += ticks[1]
    return user / _TICKS, system / _TICKS


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (everything but idle and iowait)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    # guest time is already inside user and nice.
    return (sum(values[:8]) - idle) / _TICKS


def rss_kib(pids: Iterable[int]) -> int:
    """Resident set size in KiB, summed over these processes."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total


def children(pid: int) -> list[int]:
    """The direct children of a process (nginx's workers under its master)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.extend(int(c) for c in (task / "children").read_text().split())
    except OSError:
        pass
    return found
