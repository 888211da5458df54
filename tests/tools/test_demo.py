"""The README's first command: `streamwarden demo`, and its five commands, one per job."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
import time


def test_demo_shows_each_of_the_five_jobs_and_ends_cleanly_on_sigterm() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "streamwarden.cli", "demo", "--port", "0", "--for", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    logged: list[str] = []
    try:
        assert demo.stdout is not None and demo.stderr is not None
        reader = threading.Thread(target=lambda: logged.extend(demo.stderr), daemon=True)
        reader.start()
        lines: list[str] = []
        deadline = time.monotonic() + 10
        while len([line for line in lines if line.strip().startswith("curl")]) < 5:
            assert time.monotonic() < deadline, lines
            lines.append(demo.stdout.readline())
        commands = [shlex.split(line.strip()) for line in lines if line.strip().startswith("curl")]
        commands[4] = shlex.split(lines[-1].strip().split(" | ")[0])  # the metrics, unpiped
        # 1. No buffering: the headers say so, the tokens come one by one.
        normal = subprocess.run(commands[0], capture_output=True, text=True, timeout=15)
        assert "x-accel-buffering: no" in normal.stdout.lower()
        assert "no-transform" in normal.stdout and "content-length" not in normal.stdout.lower()
        assert normal.stdout.rstrip().endswith("data: [DONE]")
        assert len(re.findall(r'"content":"', normal.stdout)) >= 10
        # 2. Keep-alive.
        stalled = subprocess.run(
            [*commands[1], "--max-time", "5"], capture_output=True, text=True, timeout=15
        )
        assert ": keep-alive" in stalled.stdout
        # 3. Honest endings.
        truncated = subprocess.run(commands[2], capture_output=True, text=True, timeout=15)
        assert '"code":"stream_truncated"' in truncated.stdout
        # 4. Cancellation: the client gives up (curl's own timeout, as a Ctrl-C would).
        subprocess.run([*commands[3], "--max-time", "1"], capture_output=True, timeout=15)
        deadline = time.monotonic() + 10
        while not any("client_cancelled" in line for line in logged):
            assert time.monotonic() < deadline, logged
            time.sleep(0.05)  # polling the log reader's list for the line
        cancelled = next(line for line in logged if "client_cancelled" in line)
        assert "cancel_propagation_s" in cancelled and "tokens_zombie" in cancelled
        # 5. Metering.
        metrics = subprocess.run(commands[4], capture_output=True, text=True, timeout=15)
        assert "streamwarden_tokens_generated_total{" in metrics.stdout
        assert 'end_state="client_cancelled"' in metrics.stdout
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=10)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(timeout=10)
    assert demo.returncode == 0
