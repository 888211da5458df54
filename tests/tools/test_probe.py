"""``streamwarden probe`` through real hops on loopback, each showing its verdict.

Every hop is real: nginx from Debian (buffering on and off, gzip, a short
``proxy_read_timeout``), the sidecar, and the mock upstream with its faults.
The probe runs as the ``streamwarden probe`` command in a subprocess, as a
user runs it. Before trusting a verdict, the test checks what the path does
with a client of its own (aiohttp, reading the body as it comes), so a
verdict of "buffered" is compared with a path that really lumps.

The analysis is also checked on made-up captures (no network), where the
reads and their times are exactly known.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from locations import REPO
from nginx import free_port, needs_nginx, running_nginx
from sidecars import StartSidecar
from streamwarden.core.sse import SSEDecoder
from streamwarden.tools.mock import MockServer, MockSettings, start_mock
from streamwarden.tools.probe.measure import (
    CLOCK_SKEW_SECONDS,
    Capture,
    Ending,
    Finding,
    Read,
    Symptom,
    analyse,
    read_stamp,
    render_text,
    send_stamp,
)

# 12 tokens at 10 per second: a stream of ~1.3 s, slow enough that a hop's
# buffering shows, short enough for the suite.
PACE = ["-H", "x-mock-tokens: 12", "-H", "x-mock-tps: 10", "-H", "x-mock-ttft: 0.1"]
PACE_HEADERS = {"x-mock-tokens": "12", "x-mock-tps": "10", "x-mock-ttft": "0.1"}


async def probe(url: str, *args: str, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """Run ``streamwarden probe URL --json ARGS`` and return its exit code and report."""
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "streamwarden.cli",
        "probe",
        url,
        "--json",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None
    assert out, err.decode()
    return process.returncode, json.loads(out)


def verdict(report: dict[str, Any], symptom: str) -> dict[str, Any]:
    (found,) = [v for v in report["verdicts"] if v["symptom"] == symptom]
    return found


def site(upstream_port: int, listen_port: int, directives: str) -> str:
    return (
        "server {\n"
        f"    listen 127.0.0.1:{listen_port};\n"
        f"    {directives}\n"
        "    location / {\n"
        f"        proxy_pass http://127.0.0.1:{upstream_port};\n"
        "    }\n"
        "}\n"
    )


# A hop that really lumps: nginx honours an upstream's X-Accel-Buffering
# and flushes small streams quickly, so it is told to ignore the header, to
# hold up to 512 KiB, and to read the upstream over HTTP/1.0.
BUFFERING = (
    "proxy_buffering on; proxy_ignore_headers X-Accel-Buffering; proxy_buffer_size 64k; "
    "proxy_buffers 8 64k; proxy_busy_buffers_size 128k; proxy_http_version 1.0;"
)
NOT_BUFFERING = "proxy_buffering off; proxy_http_version 1.1;"


async def done_at_first_event(url: str, mock: MockServer, request_id: str) -> tuple[int, bool]:
    """Read a paced stream with aiohttp as bytes come: its data lines, and whether
    the mock had written its whole answer when the first of them arrived."""
    headers = {**PACE_HEADERS, "x-mock-request-id": request_id}
    lines, done_at_first = 0, False
    async with aiohttp.ClientSession(auto_decompress=True) as session, asyncio.timeout(20):
        async with session.post(
            url + "/v1/chat/completions", headers=headers, json={"stream": True}
        ) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: "):
                    if lines == 0:
                        record = mock.stats.get(request_id)
                        done_at_first = record is not None and record.completed
                    lines += 1
    return lines, done_at_first


# -- through real hops ----------------------------------------------------------------


async def test_the_direct_path_is_clean_and_every_event_is_stamped(mock: MockServer) -> None:
    code, report = await probe(mock.url, *PACE)
    assert code == 0, report["symptoms"]
    assert report["symptoms"] == []
    assert report["terminal_seen"] and report["ending"] == "complete"
    assert len(report["events"]) == 15  # role chunk, 12 tokens, finish chunk, [DONE]
    assert all(event["sent_unix"] is not None for event in report["events"])
    assert verdict(report, "buffered")["finding"] == "clear"


@needs_nginx
async def test_nginx_with_proxy_buffering_on_is_buffered(mock: MockServer, tmp_path: Path) -> None:
    # The problem without the probe: directly, the first event arrives while
    # the answer is still being written; through nginx, only after its end.
    assert await done_at_first_event(mock.url, mock, "direct") == (15, False)
    port = free_port()
    async with running_nginx(tmp_path, site(mock.port, port, BUFFERING), port) as url:
        assert await done_at_first_event(url, mock, "lumped") == (15, True)  # it really lumps
        plot = tmp_path / "probe.png"
        code, report = await probe(url, *PACE, "--plot", str(plot))
        # Without send times (a far end that is not the mock) the arrivals alone tell.
        unstamped_code, unstamped = await probe(url, *PACE, "--no-stamp")
    assert unstamped_code == 1 and "buffered" in unstamped["symptoms"], unstamped["verdicts"]
    assert all(event["sent_unix"] is None for event in unstamped["events"])
    assert code == 1
    assert "buffered" in report["symptoms"]
    buffered = verdict(report, "buffered")
    assert "waited in the path" in buffered["evidence"]
    assert "proxy_buffering off" in buffered["fix"]
    # Each event's own delay shows it: the first came out of the path only
    # after the last went in (its delay spans the whole stream's send times).
    events = report["events"]
    sending = events[-1]["sent_unix"] - events[0]["sent_unix"]
    assert events[0]["path_delay_s"] >= sending - CLOCK_SKEW_SECONDS, events
    # The events per read tell the same: few reads carried many events.
    assert max(int(n) for n in report["events_per_read"]) >= 3
    data = plot.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert 5_000 < len(data) < 500_000


@needs_nginx
async def test_nginx_with_proxy_buffering_off_is_clean(mock: MockServer, tmp_path: Path) -> None:
    port = free_port()
    async with running_nginx(tmp_path, site(mock.port, port, NOT_BUFFERING), port) as url:
        # It trickles: the first event arrives while the answer is being written.
        assert await done_at_first_event(url, mock, "trickled") == (15, False)
        code, report = await probe(url, *PACE)
    assert code == 0, report["symptoms"]
    assert verdict(report, "buffered")["finding"] == "clear"
    assert report["terminal_seen"]
    assert dict(report["headers"])["Server"].startswith("nginx")


@needs_nginx
async def test_nginx_gzip_on_event_streams_is_compressed(mock: MockServer, tmp_path: Path) -> None:
    gzip_site = (
        f"{NOT_BUFFERING} gzip on; gzip_types text/event-stream; gzip_min_length 0; "
        "gzip_proxied any;"
    )
    port = free_port()
    async with running_nginx(tmp_path, site(mock.port, port, gzip_site), port) as url:
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.post(
                url + "/v1/chat/completions",
                headers={**PACE_HEADERS, "Accept-Encoding": "gzip"},
                json={"stream": True},
            ) as response:
                assert response.headers.get("Content-Encoding") == "gzip"  # nginx added it
                body = gzip.decompress(await response.read())
        assert body.count(b"\ndata: ") + body.startswith(b"data: ") >= 15
        code, report = await probe(url, *PACE)
    assert code == 1
    assert "compressed" in report["symptoms"]
    compressed = verdict(report, "compressed")
    assert (
        "gzip" in compressed["evidence"] and "a hop on the path added it" in compressed["evidence"]
    )
    assert "nginx" in compressed["evidence"]
    assert "gzip_types" in compressed["fix"]
    # The probe read through the compression: every event, and the terminal one.
    assert len(report["events"]) == 15 and report["terminal_seen"]


@needs_nginx
async def test_a_short_proxy_read_timeout_cuts_a_stall_and_keepalives_hold_it(
    mock: MockServer, start_sidecar: StartSidecar, tmp_path: Path
) -> None:
    # The problem: nginx cuts the stream after 1 s of silence.
    cutting = f"{NOT_BUFFERING} proxy_read_timeout 1s;"
    port = free_port()
    async with running_nginx(tmp_path / "direct", site(mock.port, port, cutting), port) as url:
        code, report = await probe(url, *PACE, "--stall", "3s", "-H", "x-mock-request-id: cut")
    assert code == 1
    assert {"idle-cut", "truncated"} <= set(report["symptoms"])
    cut = verdict(report, "idle-cut")
    assert "an idle timeout" in cut["evidence"] and "keepalive_interval" in cut["fix"]
    # Cut inside the 3 s stall, not at its end: the mock was closed while
    # silent after its 6 tokens (12 // 2) and never resumed.
    upstream = await mock.stats.wait_ended("cut")
    assert upstream.closed_early and upstream.tokens_generated == 6
    # The cure: the sidecar behind the same nginx writes keep-alives in the silence.
    sidecar = await start_sidecar(mock.url, keepalive_interval=0.3)
    port = free_port()
    async with running_nginx(
        tmp_path / "sidecar", site(sidecar.proxy_port, port, cutting), port
    ) as url:
        code, report = await probe(url, *PACE, "--stall", "3s")
    assert code == 0, report["symptoms"]
    assert report["keepalives"] >= 3
    assert verdict(report, "no-keepalives")["finding"] == "clear"
    assert verdict(report, "idle-cut")["finding"] == "clear"
    assert "survived" in verdict(report, "idle-cut")["evidence"]
    assert report["terminal_seen"]
    # The events still carry the mock's send times through both hops.
    assert all(event["sent_unix"] is not None for event in report["events"])


async def test_the_sidecar_in_front_is_clean_with_keepalives_and_its_headers(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, keepalive_interval=0.2)
    code, report = await probe(f"http://127.0.0.1:{sidecar.proxy_port}", *PACE, "--stall", "1s")
    assert code == 0, report["symptoms"]
    assert report["keepalives"] >= 2
    assert verdict(report, "no-keepalives")["finding"] == "clear"
    assert verdict(report, "missing-no-buffering-headers")["finding"] == "clear"
    # The direct path with the same stall: no keep-alives.
    code, report = await probe(mock.url, *PACE, "--stall", "1s")
    assert code == 1 and report["symptoms"] == ["no-keepalives"]


async def test_the_sidecars_own_idle_timeout_shows_as_its_error_event(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(mock.url, keepalive_interval=0.2, upstream_idle_timeout=0.5)
    code, report = await probe(f"http://127.0.0.1:{sidecar.proxy_port}", *PACE, "--stall", "2s")
    assert code == 1 and "truncated" in report["symptoms"]
    assert "upstream_timeout" in verdict(report, "truncated")["evidence"]
    assert report["ending"] == "complete" and report["keepalives"] >= 1


async def test_a_truncating_upstream_is_truncated_not_cut() -> None:
    async with await start_mock(settings=MockSettings(fault="truncate")) as truncating:
        code, report = await probe(truncating.url, *PACE)
    assert code == 1
    assert report["symptoms"] == ["truncated"]
    assert report["ending"] == "complete" and not report["terminal_seen"]
    assert "data: [DONE]" in verdict(report, "truncated")["evidence"]
    assert verdict(report, "idle-cut")["finding"] == "clear"


async def test_secrets_never_reach_the_output(mock: MockServer) -> None:
    url = mock.url.replace("http://", "http://user:hunter2@") + "/v1/chat/completions?key=sk-q"
    _, report = await probe(
        url, *PACE, "-H", "Authorization: Bearer sk-header", "-H", "x-api-key: sk-other"
    )
    text = json.dumps(report)
    for secret in ("hunter2", "sk-q", "sk-header", "sk-other"):
        assert secret not in text
    assert "[redacted]" in text and "key=..." in report["request"]["line"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ftp://example"], "http:// or https://"),
        (["http://127.0.0.1:9", "--stall", "soon"], "--stall 'soon'"),
        (["http://127.0.0.1:9", "-H", "no colon"], "-H"),
        (["http://127.0.0.1:9", "--max-bytes", "lots"], "--max-bytes"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from streamwarden.cli import main

    assert main(["probe", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# -- the analysis on made-up captures --------------------------------------------------

CHUNK = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def stamped(sent: float, block: bytes = CHUNK) -> bytes:
    return send_stamp(sent) + block


def capture(reads: list[tuple[float, bytes]], **fields: Any) -> Capture:
    values: dict[str, Any] = {
        "status": 200,
        "headers": (("Content-Type", "text/event-stream"),),
        "headers_at": 0.01,
        "reads": tuple(Read(at, data) for at, data in reads),
        "ending": Ending.COMPLETE,
        "ended_at": reads[-1][0] if reads else 0.01,
        "started_wall": 1000.0,
    }
    values.update(fields)
    return Capture(**values)


def findings(report: Any) -> dict[Symptom, Finding]:
    return {v.symptom: v.finding for v in report.verdicts}


def test_a_stamp_is_a_comment_that_leaves_the_events_unchanged() -> None:
    plain = SSEDecoder().feed(CHUNK + DONE)
    marked = SSEDecoder().feed(stamped(1000.5) + stamped(1000.6, DONE))
    assert marked == plain
    assert read_stamp(stamped(1234.000001)) == pytest.approx(1234.000001)
    assert read_stamp(CHUNK) is None


def test_events_held_in_the_path_are_buffered_and_steady_ones_are_not() -> None:
    # Sent 0.1 s apart; all arrive at once 1 s after the first was sent.
    lump = b"".join(stamped(1000.0 + i / 10) for i in range(10)) + DONE
    report = analyse(capture([(1.0, lump)]))
    assert findings(report)[Symptom.BUFFERED] is Finding.FOUND
    assert report.events_per_read == {11: 1}
    # Each event's delay: the first waited the whole stream, the last 0.1 s.
    assert [e.delay for e in report.events[:10]] == pytest.approx([1 - i / 10 for i in range(10)])
    # The same events, each arriving 5 ms after it was sent, one per read.
    reads = [(i / 10 + 0.005, stamped(1000.0 + i / 10)) for i in range(10)]
    report = analyse(capture([*reads, (1.0, DONE)]))
    assert findings(report)[Symptom.BUFFERED] is Finding.CLEAR
    assert [e.delay for e in report.events[:10]] == pytest.approx([0.005] * 10)


def test_lumps_without_send_times_are_buffered_by_their_pattern() -> None:
    lumps = [(0.5 * (i + 1), CHUNK * 4) for i in range(4)]
    report = analyse(capture([*lumps, (2.1, DONE)]))
    assert findings(report)[Symptom.BUFFERED] is Finding.FOUND
    trickle = [(0.05 * (i + 1), CHUNK) for i in range(16)]
    report = analyse(capture([*trickle, (0.9, DONE)]))
    assert findings(report)[Symptom.BUFFERED] is Finding.CLEAR


def test_a_gzipped_stream_is_read_through_and_found_compressed() -> None:
    body = gzip.compress(CHUNK * 5 + DONE)
    reads = [(0.1 + i / 100, body[i * 10 : (i + 1) * 10]) for i in range(len(body) // 10 + 1)]
    headers = (("Content-Type", "text/event-stream"), ("Content-Encoding", "gzip"))
    report = analyse(capture(reads, headers=headers))
    assert findings(report)[Symptom.COMPRESSED] is Finding.FOUND
    assert len(report.events) == 6 and report.terminal_seen


def test_a_close_after_a_silence_is_an_idle_cut_and_a_prompt_close_a_truncation() -> None:
    reads = [(0.1 * (i + 1), CHUNK) for i in range(5)]
    cut = analyse(capture(reads, ending=Ending.BROKEN, ended_at=0.5 + 60.0, stall=75.0))
    assert findings(cut)[Symptom.IDLE_CUT] is Finding.FOUND
    assert "after 60.0 s of silence" in next(
        v.evidence for v in cut.verdicts if v.symptom is Symptom.IDLE_CUT
    )
    assert findings(cut)[Symptom.NO_KEEPALIVES] is Finding.FOUND
    prompt = analyse(capture(reads, ended_at=0.55))
    assert findings(prompt)[Symptom.IDLE_CUT] is Finding.CLEAR
    assert findings(prompt)[Symptom.TRUNCATED] is Finding.FOUND


def test_keepalive_comments_are_counted_and_a_stamp_is_not_one() -> None:
    reads = [(0.1, stamped(1000.0)), (1.0, b": keep-alive\n\n"), (2.0, b": ping\n\n")]
    report = analyse(capture([*reads, (3.0, stamped(1002.9, DONE))], stall=2.5))
    assert report.keepalives == 2
    assert findings(report)[Symptom.NO_KEEPALIVES] is Finding.CLEAR
    assert len(report.events) == 2


def test_an_error_status_is_not_a_stream() -> None:
    headers = (("Content-Type", "application/json"),)
    report = analyse(capture([(0.1, b'{"error":"no"}')], status=401, headers=headers))
    assert [v.symptom for v in report.verdicts] == [Symptom.NOT_A_STREAM]
    assert report.fails


async def test_the_mock_stamps_only_when_asked(mock: MockServer) -> None:
    async def body(headers: dict[str, str]) -> bytes:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                mock.url + "/v1/chat/completions",
                headers={**headers, "x-mock-tps": "0", "x-mock-ttft": "0", "x-mock-tokens": "5"},
                json={"stream": True},
            ) as response:
                return await response.read()

    plain, marked = await body({}), await body({"x-mock-stamp": "1"})
    assert b"streamwarden-sent" not in plain
    blocks = [block for block in marked.split(b"\n\n") if block]
    assert len(blocks) == 8 and all(read_stamp(block) is not None for block in blocks)

    def contents(raw: bytes) -> list[object]:
        events = SSEDecoder().feed(raw)
        return [e.data if e.data == "[DONE]" else json.loads(e.data)["choices"] for e in events]

    assert contents(marked) == contents(plain)


def test_a_stall_the_far_end_ignored_is_untested_not_survived() -> None:
    reads = [(0.1 * (i + 1), CHUNK) for i in range(5)]
    report = analyse(capture([*reads, (0.6, DONE)], stall=3.0))
    assert findings(report)[Symptom.IDLE_CUT] is Finding.UNTESTED
    assert findings(report)[Symptom.NO_KEEPALIVES] is Finding.UNTESTED


def test_a_gzip_bomb_is_inflated_only_up_to_max_bytes() -> None:
    bomb = gzip.compress(b"data: x\n\n" * 4_000_000)  # 36 MB of events in ~100 KB
    assert len(bomb) < 200_000
    headers = (("Content-Type", "text/event-stream"), ("Content-Encoding", "gzip"))
    report = analyse(capture([(0.1, bomb)], headers=headers, max_bytes=256 * 1024))
    assert any("inflated past --max-bytes" in note for note in report.notes)
    assert len(report.events) <= 256 * 1024 // 9


def test_events_past_max_events_are_not_kept() -> None:
    report = analyse(capture([(0.1, CHUNK * 50)], max_events=10))
    assert len(report.events) == 10
    assert any("--max-events" in note for note in report.notes)


async def test_max_bytes_stops_the_probe_reading() -> None:
    async with await start_mock(settings=MockSettings(tokens=2000, tokens_per_second=0)) as server:
        code, report = await probe(server.url, "--max-bytes", "4KiB")
    assert report["ending"] == "too-large"
    assert 4096 <= report["body_bytes"] < 2000 * 100
    assert verdict(report, "truncated")["finding"] == "untested"
    assert code == 0


def test_the_text_report_shows_headers_events_verdicts_and_the_result() -> None:
    reads = [(0.1 * (i + 1), stamped(1000.0 + 0.1 * i)) for i in range(3)]
    report = analyse(capture(reads, ending=Ending.BROKEN, error="reset"))
    text = render_text(
        report, "POST http://h/v1/chat/completions", [("Authorization", "[redacted]")]
    )
    assert "> Authorization: [redacted]" in text
    assert "< Content-Type: text/event-stream" in text
    assert "broken (reset), without data: [DONE]" in text
    assert "truncated                      FOUND" in text
    assert text.rstrip().endswith("result: truncated")
