"""The documentation's reference tables, each made from the code that it describes.

Every generated table of ``docs/`` sits between two HTML comments, and
:data:`TABLES` names the page, the comments and the one function that makes
it (the settings model's, the collectors', the plan's...). ``python -m
streamwarden.tools.reference`` names the tables that differ from the code
(exit 1 when one does); ``--write`` puts the code's tables in. A test holds
every page to its table, so a change to the code fails until its page is
written again.

The error codes and end states are made here, from :class:`ErrorCode`,
:class:`EndState` and each dialect's own error event; what each SDK raises
on them is :data:`SDK_ERRORS`, which the SDK matrix
(``tests/faces/test_sdk_error_events.py``) holds to the SDKs it runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from streamwarden.core.dialects.gemini import Gemini
from streamwarden.core.endings import ENDINGS, ErrorCode
from streamwarden.core.meter import EndState

__all__ = ["END_STATES", "SDK_ERRORS", "TABLES", "Table", "end_state_table", "error_table", "main"]

#: What each end state means (the metrics' ``end_state`` label, the log line's field).
END_STATES: dict[EndState, str] = {
    EndState.COMPLETED: "the stream reached its terminal event (or, for `generic`, a clean end)",
    EndState.CLIENT_CANCELLED: "the client left and the upstream was closed at once "
    "(`on_client_gone: cancel`)",
    EndState.UPSTREAM_TRUNCATED: "the upstream ended without its terminal event, or inside "
    "an event or a tool call",
    EndState.UPSTREAM_ERROR: "the upstream broke off (a reset, a broken chunked body), or "
    "closed a tool call broken",
    EndState.UPSTREAM_TIMEOUT: "the upstream sent nothing for `upstream_idle_timeout`",
    EndState.CLIENT_TOO_SLOW: "the client did not take a write within `client_write_timeout`",
    EndState.LIMIT_EXCEEDED: "a limit was passed: `max_stream_duration`, `max_event_bytes`, "
    "`max_tool_arguments_bytes` or `max_tool_arguments_depth`",
    EndState.SHUTDOWN: "the stream was still open when a drain ran past `drain_timeout`",
    EndState.DRAINED: "the client left and the upstream was read to its end, writing "
    "nothing (`on_client_gone: drain`)",
    EndState.DETACHED_EXPIRED: "the client left a resumable stream and nobody resumed it "
    "within `resume_window` (`on_client_gone: detach`)",
    EndState.BLOCKED: "an output filter with `action: block` matched (`content_blocked`)",
}

#: What each SDK raises on an error event of ours, and where it shows the code:
#: the SDK matrix's names (tests/faces/test_sdk_error_events.py) -> (exception, where).
SDK_ERRORS: dict[str, tuple[str, str]] = {
    "openai-chat": ("openai.APIError", "`.code`, and `(code)` at the end of `.message`"),
    "openai-responses": ("openai.APIError", "`.code`, and `(code)` at the end of `.message`"),
    "anthropic": (
        "anthropic.APIStatusError",
        "`.body['error']['code']`, and `(code)` at the end of the message",
    ),
    "google-genai": (
        "google.genai.errors.APIError",
        "`.code` and `.status` as in the Gemini column (a `ServerError` or `ClientError`); the "
        "code in `.details` (an `ErrorInfo` with domain `streamwarden`) and the message",
    ),
    "ollama": ("ollama.ResponseError", "`(code)` at the end of `.error`"),
    "cohere": (
        "httpx.TransportError",
        "the SDK raises on no event, so the body breaks after ours: first the `message-end` "
        "event it yields, `finish_reason` `ERROR`, `(code)` at the end of `delta.error`; then "
        "the broken body's `httpx.RemoteProtocolError` (a reset's may be a `ReadError`)",
    ),
    "huggingface_hub": (
        "huggingface_hub.errors.TextGenerationError",
        "the subclass TGI's `error_type` names (`IncompleteGenerationError` for a cut, "
        "`GenerationError`, `OverloadedError`, `ValidationError`); `(code)` at the end of "
        "the message",
    ),
    "mistralai": (
        "mistralai.client.errors.ResponseValidationError",
        "its chat stream has no error event: it fails to read ours as a chunk and raises this "
        "`MistralError` (`.status_code` 200); the event in `.body`: "
        "`data.error.code`, and `(code)` at the end of `data.error.message`",
    ),
    "vercel-ai": (
        "Error",
        "the AI SDK's `readUIMessageStream` (JavaScript) throws it with the error part's "
        "text, `(code)` at its end",
    ),
}


def _gemini_status(code: ErrorCode) -> str:
    """The HTTP status and google.rpc code of the Gemini dialect's error event for a code."""
    event = Gemini().error_event(code.value, "x").decode()
    data = json.loads(event.partition("data:")[2])
    return f"{data['error']['code']} `{data['error']['status']}`"


def error_table() -> str:
    """Every code an error event of ours carries, with its stream's end state (Markdown)."""
    rows = [
        "| code | end state | what the client is told | Gemini status |",
        "|---|---|---|---|",
    ]
    for code in ErrorCode:
        ending = ENDINGS.get(code)  # None: an answer to a resume, no stream of its own
        if ending is None:
            state, told = "none: the answer to a resume", "see [Resume](../resume.md)"
        else:
            # The message's blanks, filled per stream (the terminal event, a limit), in italics.
            state, told = f"`{ending[0].value}`", re.sub(r"\{(\w+)(?::\w)?\}", r"*\1*", ending[1])
        rows.append(f"| `{code.value}` | {state} | {told} | {_gemini_status(code)} |")
    return "\n".join(rows) + "\n"


def end_state_table() -> str:
    """Every end state, with what it means (Markdown)."""
    missing = set(EndState) - set(END_STATES)
    if missing:
        raise KeyError(f"END_STATES says nothing of {sorted(missing)}")
    rows = ["| end state | when |", "|---|---|"]
    rows += [f"| `{state.value}` | {END_STATES[state]} |" for state in EndState]
    return "\n".join(rows) + "\n"


def sdk_table() -> str:
    """What each SDK raises on an error event, and where it shows the code (Markdown)."""
    rows = ["| SDK (stream) | raises | the code is in |", "|---|---|---|"]
    rows += [f"| {name} | `{raised}` | {where} |" for name, (raised, where) in SDK_ERRORS.items()]
    return "\n".join(rows) + "\n"


def _metric_table() -> str:
    from streamwarden.observation.metrics import metric_table

    return metric_table()


def _log_fields() -> str:
    from streamwarden.observation.logs import field_table

    return field_table()


def _span_attributes() -> str:
    from streamwarden.observation.telemetry import attribute_table

    return attribute_table()


def _genai_metrics() -> str:
    from streamwarden.observation.telemetry import instrument_table

    return instrument_table()


def _parity() -> str:
    from streamwarden.pipeline.parity import parity_table

    return parity_table() + "\n"


def _settings() -> str:
    from streamwarden.config import settings_table

    return settings_table()


@dataclass(frozen=True, slots=True)
class Table:
    """One generated table: its page (under docs/), its two comments, its one generator."""

    page: str
    start: str
    end: str
    make: Callable[[], str]

    def published(self, docs: Path) -> str:
        """The table as the page holds it now."""
        text = (docs / self.page).read_text()
        if self.start not in text or self.end not in text:
            raise LookupError(f"docs/{self.page} has no {self.start!r} ... {self.end!r}")
        return text.split(self.start, 1)[1].split(self.end, 1)[0]

    def write(self, docs: Path) -> None:
        path = docs / self.page
        head, rest = path.read_text().split(self.start, 1)
        tail = rest.split(self.end, 1)[1]
        path.write_text(f"{head}{self.start}{self.make()}{self.end}{tail}")


def _table(page: str, what: str, generator: str, make: Callable[[], str]) -> Table:
    return Table(
        page, f"<!-- {what}: generated by {generator} -->\n", f"<!-- end of {what} -->", make
    )


#: Every generated table of the docs, by page.
TABLES: tuple[Table, ...] = (
    _table(
        "reference/configuration.md",
        "settings table",
        "`streamwarden.config.settings_table`",
        _settings,
    ),
    _table(
        "reference/metrics.md",
        "metrics table",
        "`python -m streamwarden.observation.metrics`",
        _metric_table,
    ),
    _table(
        "reference/metrics.md",
        "log fields",
        "`python -m streamwarden.observation.logs`",
        _log_fields,
    ),
    _table(
        "reference/errors.md",
        "error codes",
        "`streamwarden.tools.reference.error_table`",
        error_table,
    ),
    _table(
        "reference/errors.md",
        "end states",
        "`streamwarden.tools.reference.end_state_table`",
        end_state_table,
    ),
    _table(
        "reference/errors.md", "sdk errors", "`streamwarden.tools.reference.sdk_table`", sdk_table
    ),
    _table("reference/parity.md", "parity table", "`python -m streamwarden.pipeline`", _parity),
    _table(
        "opentelemetry.md",
        "span attributes",
        "`streamwarden.observation.telemetry.attribute_table`",
        _span_attributes,
    ),
    _table(
        "opentelemetry.md",
        "genai metrics",
        "`streamwarden.observation.telemetry.instrument_table`",
        _genai_metrics,
    ),
)

#: docs/ of the checkout this module runs from (an editable install, or the tree).
DOCS = Path(__file__).resolve().parents[3] / "docs"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamwarden.tools.reference",
        description="Check (or --write) the docs' reference tables against the code.",
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs directory (%(default)s)")
    parser.add_argument("--write", action="store_true", help="write the code's tables in")
    args = parser.parse_args(argv)
    stale = [t for t in TABLES if t.published(args.docs) != t.make()]
    for table in stale:
        if args.write:
            table.write(args.docs)
        print(f"{'wrote' if args.write else 'differs'}: docs/{table.page} {table.start.strip()}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
