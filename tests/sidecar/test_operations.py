"""Operating the sidecar: drain on SIGTERM, health, metrics that agree with logs and the mock,
and logs that never carry secrets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecars import StartSidecar
from streamwarden.tools.mock import MockServer
from waiting import wait_for, wait_until

CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_command(upstream: str, port: int, *flags: str) -> list[str]:
    """``streamwarden run`` in a subprocess, listening on loopback ``port``."""
    return [
        *(sys.executable, "-m", "streamwarden.cli", "run", "--upstream", upstream),
        *("--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{free_port()}"),
        *flags,
    ]


async def read_stream(url: str, headers: dict[str, str]) -> bytes:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, headers=headers, json={"stream": True}) as response:
            return await response.read()


async def get_status(url: str) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return response.status


# -- drain -------------------------------------------------------------------------


async def test_drain_lets_short_streams_finish_and_ends_long_ones_honestly(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, drain_timeout="600ms")
    short = {
        "x-mock-tps": "20",
        "x-mock-ttft": "0",
        "x-mock-tokens": "6",
        "x-mock-request-id": "short",
    }
    long = {
        "x-mock-tps": "20",
        "x-mock-ttft": "0",
        "x-mock-tokens": "200",
        "x-mock-request-id": "long",
    }
    short_task = asyncio.create_task(read_stream(sidecar.proxy_url + CHAT, short))
    long_task = asyncio.create_task(read_stream(sidecar.proxy_url + CHAT, long))
    await wait_for(lambda: len(sidecar.tracker.active) == 2, what="both streams open")
    draining = asyncio.create_task(sidecar.drain())
    await wait_for(lambda: sidecar.draining, what="the drain started")
    assert await get_status(sidecar.admin_url + "/readyz") == 503  # at once
    # The listener closes on the drain's first step (the close itself may land
    # a loop turn later).
    await wait_until(refused(sidecar.proxy_port), what="the listener closed")
    short_body, long_body = await asyncio.gather(short_task, long_task)
    await draining
    assert short_body.endswith(b"data: [DONE]\n\n")  # finished untouched
    assert b'"code":"shutting_down"' in long_body.rsplit(b"\n\n", 2)[-2]
    records = {r.meter.end_state for r in sidecar.tracker.finished}
    assert records == {"completed", "shutdown"}
    short_record = await mock.stats.wait_ended("short", timeout=2)
    long_record = await mock.stats.wait_ended("long", timeout=2)
    # The drain waited for the short stream, then cut the long one (its 10 s
    # answer cut short), in that order: neither at once nor at the long one's end.
    assert long_record.closed_early and long_record.tokens_generated < 200
    assert short_record.ended_at is not None and long_record.closed_at is not None
    assert short_record.ended_at <= long_record.closed_at


async def test_a_client_leaving_during_the_drain_ends_its_stream_and_the_drain_early(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    """A stream whose client leaves mid-drain is cancelled at once, not held to the timeout."""
    sidecar = await start_sidecar(mock.url, drain_timeout="5s")
    headers = {"x-mock-tps": "0", "x-mock-ttft": "30", "x-mock-request-id": "left-in-drain"}
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            sidecar.proxy_url + CHAT, headers=headers, json={"stream": True}
        )
        assert response.status == 200
        draining = asyncio.create_task(sidecar.drain())
        await wait_for(lambda: sidecar.draining, what="the drain started")
        await wait_until(refused(sidecar.proxy_port), what="the drain past its first step")
        assert not draining.done()  # the silent stream holds the drain
        response.close()  # the client leaves during the shutdown
        await asyncio.wait_for(draining, 10)
    [record] = sidecar.tracker.finished
    # Cancelled for its client: the drain's timeout would have ended it as `shutdown`.
    assert record.meter.end_state == "client_cancelled"
    upstream = await mock.stats.wait_ended("left-in-drain", timeout=2)
    assert upstream.closed_early


def refused(port: int) -> Callable[[], Awaitable[bool]]:
    """A probe: whether ``port`` on loopback refuses connections."""

    async def probe() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return True
        writer.close()
        return False

    return probe


def not_ready(admin: int) -> Callable[[], Awaitable[bool]]:
    """A probe: whether the admin port's ``/readyz`` answers 503."""

    async def probe() -> bool:
        return await get_status(f"http://127.0.0.1:{admin}/readyz") == 503

    return probe


async def stream_in_flight(mock: MockServer, port: int, request_id: str) -> asyncio.Task[bytes]:
    """A 20 s stream through the sidecar on ``port``, once its upstream has sent a token."""
    headers = {
        "x-mock-tps": "20",
        "x-mock-ttft": "0",
        "x-mock-tokens": "400",
        "x-mock-request-id": request_id,
    }
    stream = asyncio.create_task(read_stream(f"http://127.0.0.1:{port}{CHAT}", headers))

    def streaming() -> bool:
        record = mock.stats.get(request_id)
        return record is not None and record.tokens_generated > 0

    await wait_for(streaming, what=f"{request_id} streaming")
    return stream


async def wait_port(port: int, timeout: float = 10) -> float:
    start = time.monotonic()
    async with asyncio.timeout(timeout):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return time.monotonic() - start
            except OSError:
                await asyncio.sleep(0.01)


@pytest.fixture
async def sidecar_process(
    mock: MockServer, tmp_path: Path
) -> AsyncIterator[tuple[subprocess.Popen[str], int, int]]:
    port, admin = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"upstream: {mock.url}\nlisten: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\n"
        "drain_timeout: 1s\nlog_level: debug\nredact_headers: [x-team-token]\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "streamwarden.cli", "run", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        await wait_port(port)
        yield process, port, admin
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=5)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
async def test_sigterm_drains_then_exits_zero_within_the_drain_timeout(
    sidecar_process: tuple[subprocess.Popen[str], int, int], mock: MockServer, signum: int
) -> None:
    """SIGHUP too (a closed terminal, a supervisor's reload): before, it killed the
    process with every stream cut mid-event, no error event, no chunk terminator."""
    process, port, admin = sidecar_process
    stream = await stream_in_flight(mock, port, "drained")
    process.send_signal(signum)
    # 503 from the moment the process handles the signal, all through its drain.
    await wait_until(not_ready(admin), what="/readyz 503 after the signal")
    body = await stream
    # Ended by the drain's timeout (its 20 s answer not over), then the exit.
    assert b'"code":"shutting_down"' in body
    async with asyncio.timeout(10):
        while process.poll() is None:
            await asyncio.sleep(0.01)  # polling the process's exit
    assert process.returncode == 0


async def test_a_second_signal_ends_the_process_at_once(
    sidecar_process: tuple[subprocess.Popen[str], int, int], mock: MockServer
) -> None:
    process, port, admin = sidecar_process
    stream = await stream_in_flight(mock, port, "interrupted")
    process.send_signal(signal.SIGTERM)
    await wait_until(not_ready(admin), what="the drain started")
    process.send_signal(signal.SIGINT)
    async with asyncio.timeout(10):
        while process.poll() is None:
            await asyncio.sleep(0.01)  # polling the process's exit
    # Cut, not drained: a drained stream ends cleanly with its shutting_down event.
    with pytest.raises(aiohttp.ClientError):
        await stream


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_startup_costs_under_a_second_of_cpu(mock: MockServer, tmp_path: Path) -> None:
    """Start-up is cheap: judged by the CPU it takes, which a busy machine does not stretch.

    (Wall time to the open port is 0.4-0.5 s on a quiet 2-core machine, and
    over a second when three test suites share it.)
    """
    port = free_port()
    process = subprocess.Popen(run_command(mock.url, port), stderr=subprocess.DEVNULL)
    try:
        await wait_port(port)
        assert _cpu_seconds(process.pid) < 1.0
    finally:
        process.terminate()
        process.wait(timeout=5)


# -- health -----------------------------------------------------------------------


async def test_readyz_checks_the_upstream_when_asked(start_sidecar: StartSidecar) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    plain = await start_sidecar(dead)
    assert await get_status(plain.admin_url + "/readyz") == 200
    assert await get_status(plain.admin_url + "/healthz") == 200
    checking = await start_sidecar(dead, readiness_check_upstream=True)
    assert await get_status(checking.admin_url + "/readyz") == 503
    assert await get_status(checking.admin_url + "/healthz") == 200


async def test_readyz_is_ready_when_the_upstream_answers(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, readiness_check_upstream=True)
    assert await get_status(sidecar.admin_url + "/readyz") == 200


# -- metrics agree with logs and with the mock --------------------------------------


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


async def test_metrics_logs_and_the_mock_agree_on_every_count(
    mock: MockServer, start_sidecar: StartSidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="streamwarden.stream")
    sidecar = await start_sidecar(mock.url, upstream_idle_timeout="200ms")
    base = {"x-mock-tps": "100", "x-mock-ttft": "0", "x-mock-tokens": "10"}
    plans = (
        [({}, None)] * 4
        + [({"x-mock-fault": "truncate"}, None)] * 3
        + [({"x-mock-fault": "stall", "x-mock-fault-after": "4"}, None)] * 2
        + [({"x-mock-fault": "stall", "x-mock-fault-after": "3"}, "leave")] * 3
    )
    for i, (extra, action) in enumerate(plans):
        headers = {**base, **extra, "x-mock-request-id": f"r{i}"}
        async with aiohttp.ClientSession() as session:
            request = {"stream": True, "stream_options": {"include_usage": True}}
            async with session.post(
                sidecar.proxy_url + CHAT, headers=headers, json=request
            ) as response:
                if action == "leave":
                    received = b""
                    while received.count(b'"content":"') < 4:  # the role chunk's and 3
                        received += await response.content.readany()
                    # The client has the 3 tokens before the upstream's
                    # endless silence: it leaves while the sidecar waits on it.
                    response.close()
                else:
                    await response.read()
        await mock.stats.wait_ended(f"r{i}", timeout=3)
    # The sidecar has recorded (metrics, log line) every stream.
    await wait_for(
        lambda: len(sidecar.tracker.finished) == len(plans) and not sidecar.tracker.active,
        what="every stream recorded",
    )

    async with aiohttp.ClientSession() as session:
        async with session.get(sidecar.admin_url + "/metrics") as response:
            metrics = scrape(await response.text())
    lines = [
        json.loads(r.getMessage()) if r.getMessage().startswith("{") else r.__dict__["fields"]
        for r in caplog.records
        if r.name == "streamwarden.stream"
    ]
    assert len(lines) == len(plans)

    by_state = Counter(line["end_state"] for line in lines)
    assert by_state == {
        "completed": 4,
        "upstream_truncated": 3,
        "upstream_timeout": 2,
        "client_cancelled": 3,
    }
    for state, count in by_state.items():
        key = (
            "streamwarden_streams_total",
            (("dialect", "openai-chat"), ("end_state", state), ("route", "/")),
        )
        assert metrics[key] == count

    mock_generated = sum(record.tokens_generated for record in mock.stats.records)
    logged_generated = sum(line["tokens_generated"] for line in lines)
    logged_delivered = sum(line["tokens_delivered"] for line in lines)
    assert logged_generated == mock_generated == 4 * 10 + 3 * 5 + 2 * 4 + 3 * 3

    def summed(name: str) -> float:  # over the source label
        return sum(
            value
            for (metric, labels), value in metrics.items()
            if metric == name and ("dialect", "openai-chat") in labels
        )

    assert summed("streamwarden_tokens_generated_total") == logged_generated
    assert summed("streamwarden_tokens_delivered_total") == logged_delivered
    synthesized = {
        code: metrics.get(("streamwarden_synthesized_errors_total", (("code", code),)), 0)
        for code in ("stream_truncated", "upstream_timeout")
    }
    assert synthesized == {"stream_truncated": 3, "upstream_timeout": 2}
    assert metrics[("streamwarden_ttft_seconds_count", (("dialect", "openai-chat"),))] == 12
    assert metrics[("streamwarden_cancel_propagation_seconds_count", ())] == 3
    assert metrics[("streamwarden_active_streams", ())] == 0
    completed = [line for line in lines if line["end_state"] == "completed"]
    assert all(line["tokens_method"] == "usage" for line in completed)
    cancelled = [line for line in lines if line["end_state"] == "client_cancelled"]
    assert all(line["cancel_propagation_s"] is not None for line in cancelled)


# -- logs ----------------------------------------------------------------------------


async def test_secrets_never_reach_the_logs(
    sidecar_process: tuple[subprocess.Popen[str], int, int],
) -> None:
    process, port, _ = sidecar_process
    secrets = {
        "Authorization": "Bearer sk-live-SECRET1",
        "x-api-key": "sk-ant-SECRET2",
        "api-key": "azure-SECRET3",
        "Cookie": "session=SECRET4",
        "x-team-token": "SECRET5",
    }
    headers = {**secrets, "x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "3"}
    body = await read_stream(f"http://127.0.0.1:{port}{CHAT}", headers)
    assert body.endswith(b"data: [DONE]\n\n")
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=10)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(line.get("msg") == "stream finished" for line in lines)
    request_lines = [line for line in lines if line.get("msg") == "request"]
    assert request_lines, "the debug request line logs the headers"
    assert request_lines[0]["headers"]["Authorization"] == "[redacted]"
    assert request_lines[0]["headers"]["x-team-token"] == "[redacted]"
    for n in range(1, 6):
        assert f"SECRET{n}" not in stderr
    # Bodies are never logged either.
    assert "naïve" not in stderr and "Streams" not in stderr


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ([], {}, "uvloop"),  # auto: uvloop is installed with the test extra
        (["--event-loop", "asyncio"], {}, "asyncio"),
        ([], {"STREAMWARDEN_EVENT_LOOP": "asyncio"}, "asyncio"),
        (["--uvloop"], {"STREAMWARDEN_EVENT_LOOP": "asyncio"}, "uvloop"),  # flags win
    ],
    ids=["auto", "flag", "env", "flag-over-env"],
)
async def test_the_event_loop_is_uvloop_when_installed_unless_configured(
    mock: MockServer, flags: list[str], env: dict[str, str], expected: str
) -> None:
    pytest.importorskip("uvloop")
    port = free_port()
    process = subprocess.Popen(
        run_command(mock.url, port, "--log-format", "text", *flags),
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        await wait_port(port)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
        process.wait(timeout=5)
    [started] = [line for line in stderr.splitlines() if "listening on" in line]
    assert started.endswith(f"event loop {expected}"), started
