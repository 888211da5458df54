"""Logging: the process's own lines and one structured line per finished stream.

The stream line carries what an operator needs to judge one stream (route,
dialect, status, end state, error code, timings, events, bytes, tokens and
how they were counted, keep-alives, cancel propagation) and never a request
or response body. Headers never appear in it; anything that logs headers
goes through :func:`streamwarden.headers.redact`.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from streamwarden.config import Settings
from streamwarden.meter import StreamRecord

__all__ = ["JSONFormatter", "configure_logging", "stream_logger"]

STREAM_LOGGER = "streamwarden.stream"


class JSONFormatter(logging.Formatter):
    """One JSON object per line; a record's ``fields`` extra is merged in."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return text


def configure_logging(settings: Settings) -> None:
    """Send the ``streamwarden`` loggers to stderr in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("streamwarden")
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    root.propagate = False


def stream_fields(record: StreamRecord) -> dict[str, Any]:
    """The fields of a finished stream's log line."""
    return {
        "stream_id": record.stream_id,
        "route": record.route,
        "method": record.method,
        "path": record.path,
        "status": record.status,
        "dialect": record.dialect,
        **record.meter.as_record(),
    }


def stream_logger() -> Callable[[StreamRecord], None]:
    """A listener that logs each finished stream as one line."""
    logger = logging.getLogger(STREAM_LOGGER)

    def log_stream(record: StreamRecord) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info("stream finished", extra={"fields": stream_fields(record)})

    return log_stream
