"""The middleware's log lines, in a real uvicorn process: one per finished stream, in the
format asked for, with no logging set up by hand, and an app's own logging left alone.

``streamwarden run`` configures logging for its process; the middleware lives in
the app's, where Python's default is no handler and level WARNING. So each test
starts uvicorn on :mod:`middleware_apps` (``StreamWardenMiddleware`` in front of
a raw ASGI app), makes one stream that completes and one whose app raises after
its response started, stops the server and reads everything it wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from broken import read_broken
from middleware_apps import running


async def two_streams(base: str) -> None:
    """A stream that completes, then one whose app raises mid-stream."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        completed = await client.get(f"{base}/guarded/raw/quiet?s=0")
        # A generic stream: its error event, then its body broken, as directly.
        broken = await read_broken(client, "GET", f"{base}/guarded/raw/raise")
    assert completed.content.endswith(b"data: last\n\n")
    assert b"upstream_error" in broken


async def server_output(tmp_path: Path, **options: Any) -> list[str]:
    """Run uvicorn with ``options``, make the two streams, stop it; every line it wrote."""
    with running("uvicorn", tmp_path, **options) as server:
        await two_streams(server.url)
    # Stopped: every request has run to its end and every line is written.
    return server.log_path.read_text().splitlines()


def printed_bare(lines: list[str]) -> list[str]:
    """The app-error line as Python's last-resort handler prints it: no time, level or name."""
    return [line for line in lines if line.startswith("the app raised")]


async def test_with_no_logging_set_up_each_stream_is_one_json_line(tmp_path: Path) -> None:
    lines = await server_output(tmp_path)  # no options at all: log_format json, level info
    records = [json.loads(line) for line in lines if line.startswith("{")]
    streams = [r for r in records if r["logger"] == "streamwarden.stream"]
    assert [(r["level"], r["msg"], r["end_state"]) for r in streams] == [
        ("info", "stream finished", "completed"),
        ("info", "stream finished", "upstream_error"),
    ]
    assert streams[1]["error_code"] == "upstream_error"
    assert all(r["status"] == 200 and r["dialect"] == "generic" for r in streams)
    # The app's exception: through the logger, with its level, name and traceback.
    (error,) = [r for r in records if r["logger"] == "streamwarden.middleware"]
    assert error["level"] == "error"
    assert error["msg"].startswith("the app raised after its stream had started")
    assert "RuntimeError: the provider broke off" in error["exc"]
    assert printed_bare(lines) == []
    assert not any(line.startswith("Traceback") for line in lines)  # only inside "exc"


async def test_log_format_text_and_log_level_apply_without_options_in_code(
    tmp_path: Path,
) -> None:
    text = await server_output(tmp_path / "text", environ={"STREAMWARDEN_LOG_FORMAT": "text"})
    finished = [line for line in text if " INFO streamwarden.stream: stream finished " in line]
    assert len(finished) == 2
    assert "end_state=completed" in finished[0] and "end_state=upstream_error" in finished[1]
    (error,) = [i for i, line in enumerate(text) if " ERROR streamwarden.middleware: " in line]
    assert text[error + 1] == "Traceback (most recent call last):"
    assert "RuntimeError: the provider broke off" in text
    assert not any(line.startswith("{") for line in text)
    assert printed_bare(text) == []
    # log_level: warning keeps the stream lines out, not the error.
    quiet = await server_output(
        tmp_path / "warning",
        environ={"STREAMWARDEN_LOG_FORMAT": "text", "STREAMWARDEN_LOG_LEVEL": "warning"},
    )
    assert not any("stream finished" in line for line in quiet)
    assert sum(" ERROR streamwarden.middleware: " in line for line in quiet) == 1


LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"app": {"format": "APP %(levelname)s %(name)s: %(message)s"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "app",
            "stream": "ext://sys.stderr",
        }
    },
    "root": {"level": "INFO", "handlers": ["stderr"]},
}


@pytest.mark.parametrize("when", ["before", "after"])
async def test_an_app_that_sets_up_logging_keeps_its_own_and_gets_each_line_once(
    tmp_path: Path, when: str
) -> None:
    if when == "before":
        # uvicorn applies --log-config before it imports the app.
        config = tmp_path / "logging.json"
        config.write_text(json.dumps(LOG_CONFIG))
        options: dict[str, Any] = {"arguments": ["--log-config", str(config)]}
    else:
        # The middleware is built with nothing set up; the app sets up logging after.
        options = {
            "target": "middleware_apps:app_configuring_logging_late",
            "arguments": ["--factory"],
        }
    lines = await server_output(tmp_path, **options)
    ours = [line for line in lines if "streamwarden." in line and not line.startswith(" ")]
    # Each line once; in any order: a stream's record is published once the
    # app has unwound, which can be after its client already sent the next
    # request (seen in CI with a core burning).
    assert sorted(ours) == sorted(
        [
            "APP INFO streamwarden.stream: stream finished",
            "APP ERROR streamwarden.middleware: the app raised after its stream had started;"
            " the stream ended with upstream_error",
            "APP INFO streamwarden.stream: stream finished",
        ]
    )
    assert not any(line.startswith("{") for line in lines)  # not ours as well


FORGED = "2026-01-01 00:00:00,000 INFO streamwarden.stream: stream finished end_state=completed"
#: A path whose app raises quoting it; CR LF, U+2028, U+0085, ESC and DEL percent-encoded.
QUOTED = "/raise-quoting%0D%0A" + FORGED.replace(" ", "%20") + "%E2%80%A8LS%C2%85NEL%1B%5B2K%7F"
UNSAFE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


@pytest.mark.parametrize("log_format", ["text", "json"])
async def test_a_path_cannot_forge_a_line_nor_a_traceback_line(
    tmp_path: Path, log_format: str
) -> None:
    environ = {"STREAMWARDEN_LOG_FORMAT": log_format}
    with running("uvicorn", tmp_path, environ=environ) as server:
        async with httpx.AsyncClient(timeout=10.0) as client:
            broken = await read_broken(client, "GET", f"{server.url}/guarded/raw{QUOTED}")
        assert b"upstream_error" in broken
    output = server.log_path.read_text(encoding="utf-8")
    assert output.splitlines() == output.split("\n")[:-1], "a line break besides \\n"
    lines = output.splitlines()
    assert not any(UNSAFE.search(line) for line in lines)
    assert not any(line.startswith("2026-01-01") for line in lines)
    if log_format == "json":
        records = [json.loads(line) for line in lines if line.startswith("{")]
        (finished,) = [r for r in records if r["msg"] == "stream finished"]
        assert finished["path"] == unquote(QUOTED)
        (error,) = [r for r in records if r["logger"] == "streamwarden.middleware"]
        assert f"RuntimeError: the provider broke off on {unquote(QUOTED)}" in error["exc"]
        return
    head = re.compile(r"[\d-]+ [\d:,]+ INFO streamwarden\.stream: stream finished ")
    (finished,) = [line for line in lines if head.match(line)]
    assert ' path="/raise-quoting\\r\\n2026-01-01 00:00:00,000 INFO' in finished
    # The traceback keeps its own lines; its message is one of them, escaped.
    (error,) = [i for i, line in enumerate(lines) if " ERROR streamwarden.middleware: " in line]
    assert lines[error + 1] == "Traceback (most recent call last):"
    (message,) = [line for line in lines if line.startswith("RuntimeError: ")]
    assert message == (
        "RuntimeError: the provider broke off on /raise-quoting\\r\\n"
        + FORGED
        + "\\u2028LS\\x85NEL\\x1b[2K\\x7f"
    )
