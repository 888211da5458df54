"""Logging: the process's own lines and one structured line per finished stream.

The stream line carries what an operator needs to judge one stream (route,
dialect, status, end state, error code, timings, events, bytes, tokens and
how they were counted, keep-alives, cancel propagation) and never a request
or response body. Headers never appear in it; anything that logs headers
goes through :func:`streamwarden.core.headers.redact`.

Who configures it. The sidecar owns its process: ``streamwarden run`` calls
:func:`configure_logging`. The middleware lives in an app's process, whose
logging is the app's: :func:`log_unless_configured` gives the
``streamwarden`` loggers a stderr handler of their own (``log_format``,
``log_level``) only while nobody else has configured logging, so that a
user who adds the middleware sees its lines without setting up Python
logging, and an app that has set it up keeps its own handlers, format and
levels, untouched.

No log line carries a control character from anywhere: a path, a header,
an admission review's ``uid`` or an exception's message can hold a line
feed (``%0A`` decodes to one), and a raw one would let whoever sent it
write a line of their own into the log. The formatters escape them, so no
caller has to remember to (see :func:`escape_controls`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from streamwarden.config import Settings
from streamwarden.core.meter import StreamRecord

__all__ = [
    "JSONFormatter",
    "RateLimitedWarnings",
    "configure_logging",
    "escape_controls",
    "log_unless_configured",
    "stream_logger",
]

STREAM_LOGGER = "streamwarden.stream"

#: What a line must never carry raw: the C0 controls (line feed, carriage
#: return, the escape that starts a terminal sequence), DEL, the C1 controls
#: (0x85 is a line break to Unicode, 0x9b a terminal's CSI), the line and
#: paragraph separators that ``str.splitlines`` and log viewers break on,
#: and the bidirectional overrides that make a line display other than it
#: reads.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _SHORT_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\n``, ``\\x1b``)."""
    return _UNSAFE.sub(_escaped, text)


def _json_escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


class JSONFormatter(logging.Formatter):
    """One JSON object per line; a record's ``fields`` extra is merged in.

    ``json.dumps`` escapes the C0 controls; what else is unsafe (DEL, C1,
    the Unicode separators) can only stand inside a JSON string there, where
    ``\\uXXXX`` is its exact escape: the line decodes to the same values.
    """

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
        return _UNSAFE.sub(_json_escaped, json.dumps(line, ensure_ascii=False, default=str))


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value...``, one line, and a traceback under it.

    The head and every field are escaped, and a field's value is quoted
    (logfmt's way) when it holds a space, a quote or an ``=``, so that a
    path cannot add a field of its own (``end_state=completed``) either.
    A traceback keeps its own line breaks, and only those (see
    :func:`_traceback_text`). ``exc_text``, which another handler's
    formatter may have filled unescaped, is not used.
    """

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = escape_controls(self.formatMessage(record))
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += "".join(f" {k}={_field_value(v)}" for k, v in fields.items() if v is not None)
        if record.exc_info and record.exc_info[0] is not None:
            text += "\n" + _traceback_text(record.exc_info)
        if record.stack_info:
            text += "\n" + "\n".join(map(escape_controls, record.stack_info.split("\n")))
        return text


def _field_value(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\\'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return escape_controls(text)


#: How the chunks that ``traceback`` writes itself begin (past an exception
#: group's ``  | `` margin): frames, headers, chain messages and group rules.
_TRACEBACK_OWN = (
    'File "',
    "[Previous line repeated",
    "Traceback (most recent call last):",
    "The above exception was the direct cause",
    "During handling of the above exception",
    "+",
)


def _traceback_text(exc_info: ExcInfo) -> str:
    """The traceback, broken into lines only where the ``traceback`` module breaks them.

    An exception's message and notes are the one part of a traceback that
    can quote a request: they are written on one line, their own line breaks
    escaped. Frames (source code) keep their layout. A chunk that is not
    recognised as the module's own is escaped whole: a Python that words
    its headers otherwise gets uglier tracebacks, never forgeable ones.
    """
    kind, value, tb = exc_info
    lines: list[str] = []
    for chunk in traceback.TracebackException(kind, value, tb).format():
        if chunk.lstrip(" |\n").startswith(_TRACEBACK_OWN):
            lines.extend(map(escape_controls, chunk.removesuffix("\n").split("\n")))
        else:
            lines.append(escape_controls(chunk.removesuffix("\n")))
    return "\n".join(lines)


def _formatter(settings: Settings) -> logging.Formatter:
    if settings.log_format == "json":
        return JSONFormatter()
    return TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configure_logging(settings: Settings) -> None:
    """Send the process's log lines to stderr in the configured format.

    The ``streamwarden`` loggers at ``log_level``; every other library's
    (aiohttp's server, asyncio's, redis') at WARNING through the same
    handler, so that their lines are escaped and formatted too: without a
    handler of their own Python prints them raw (its last resort), and an
    exception's message can carry a line feed from a request.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(settings))
    ours = logging.getLogger("streamwarden")
    ours.handlers[:] = [handler]
    ours.setLevel(settings.log_level.upper())
    ours.propagate = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


class _UnlessConfigured(logging.StreamHandler[TextIO]):
    """stderr, for as long as no other handler would take streamwarden's records.

    Checked at each record, not only when attached: an app may configure
    logging after the middleware is built (Starlette builds it before the
    app's lifespan runs), and from then on its handlers get the records by
    propagation; printing them here as well would print them twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or len(logging.getLogger("streamwarden").handlers) > 1:
            return
        super().emit(record)


def log_unless_configured(settings: Settings) -> bool:
    """Give the ``streamwarden`` loggers a stderr handler, unless logging is configured.

    The rule: only if neither the ``streamwarden`` logger nor the root logger
    has a handler (nobody has configured logging, the CLI's
    :func:`configure_logging` included), attach one to ``streamwarden`` in
    ``log_format``, and set that logger's level from ``log_level`` unless
    the app has set one. The first call that attaches decides for the
    process. Records still propagate; the handler goes quiet if the root
    logger (or ``streamwarden``) gets a handler later. True if attached.
    """
    logger = logging.getLogger("streamwarden")
    if logger.handlers or logging.getLogger().handlers:
        return False
    handler = _UnlessConfigured(sys.stderr)
    handler.setFormatter(_formatter(settings))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(settings.log_level.upper())
    return True


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


#: What each field of the stream line means: the docs' table of them is
#: printed from this (``python -m streamwarden.observation.logs``) and a test holds both
#: to :func:`stream_fields`.
FIELD_DOCS: dict[str, str] = {
    "stream_id": "the stream's id in this process (as in `GET /streams`)",
    "route": "the matched route prefix (`/` when none)",
    "method": "the request method",
    "path": "the request path, without its query",
    "status": "the response status",
    "dialect": "the stream's wire format",
    "end_state": "how the stream ended (one of the end states)",
    "error_code": "the code of the error event written, if one was",
    "upstream_reported_error": "the upstream sent an error inside the stream itself",
    "ttft_s": "request to first content event written to the client",
    "duration_s": "request to end of stream",
    "events_in": "events read from the upstream",
    "events_out": "events written to the client",
    "bytes_in": "body bytes read from the upstream",
    "bytes_out": "body bytes written to the client",
    "content_events_in": "events that carried content, read",
    "content_events_out": "events that carried content, written",
    "tokens_generated": "tokens the upstream generated",
    "tokens_delivered": "tokens written to the client",
    "tokens_zombie": "tokens generated after the client had gone",
    "tokens_method": "`usage` (the provider's final count) or `estimate`",
    "tokens_source": "`provider`, `provider_partial` or `estimated` (the metrics' `source`)",
    "inter_token_gap_max_s": "the longest gap between two content events written",
    "inter_token_gap_mean_s": "the mean gap between content events written",
    "keepalives": "keep-alive comments written",
    "cancel_propagation_s": "client gone noticed to upstream closed",
    "tool_calls": "the stream's tool calls, the first 16 (`id`, `name`, `end_state`:"
    " `complete`, `truncated`, `invalid` or `too_large`, `arguments_bytes`; never the"
    " arguments), or none",
}


def field_table() -> str:
    """The docs' table of the stream line's fields (docs/reference/metrics.md)."""
    rows = ["| field | what it is |", "|---|---|"]
    rows += [f"| `{name}` | {what} |" for name, what in FIELD_DOCS.items()]
    return "\n".join(rows) + "\n"


def stream_logger() -> Callable[[StreamRecord], None]:
    """A listener that logs each finished stream as one line."""
    logger = logging.getLogger(STREAM_LOGGER)

    def log_stream(record: StreamRecord) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info("stream finished", extra={"fields": stream_fields(record)})

    return log_stream


class RateLimitedWarnings:
    """At most one warning line per reason per ``interval``; the rest are only counted.

    A flood of slowloris or malformed connections must not become a flood
    of log lines (the metric counts every one of them).
    """

    def __init__(self, interval: float = 10.0, logger: logging.Logger | None = None) -> None:
        self._interval = interval
        self._log = logger or logging.getLogger("streamwarden.proxy")
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, reason: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self._interval:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        if suppressed:
            message += " (%d more like it since the last such line)"
            args = (*args, suppressed)
        self._log.warning(message, *args)


if __name__ == "__main__":
    print(field_table(), end="")
