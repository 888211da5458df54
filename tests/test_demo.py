"""The README's first command: ``streamwarden demo`` starts, and its three curl commands work."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time


def test_demo_prints_three_curl_commands_that_show_the_jobs() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "streamwarden.cli", "demo", "--port", "0", "--for", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 10
        while len([line for line in lines if line.strip().startswith("curl -N")]) < 3:
            assert time.monotonic() < deadline, lines
            lines.append(demo.stdout.readline())
        commands = [shlex.split(line.strip()) for line in lines if line.strip().startswith("curl")]
        normal = subprocess.run(commands[0], capture_output=True, text=True, timeout=15)
        assert normal.stdout.rstrip().endswith("data: [DONE]")
        assert len(re.findall(r'"content":"', normal.stdout)) >= 10
        stalled = subprocess.run(
            [*commands[1], "--max-time", "5"], capture_output=True, text=True, timeout=15
        )
        assert ": keep-alive" in stalled.stdout
        truncated = subprocess.run(commands[2], capture_output=True, text=True, timeout=15)
        assert '"code":"stream_truncated"' in truncated.stdout
    finally:
        demo.terminate()
        demo.wait(timeout=10)
    assert demo.returncode == 0
