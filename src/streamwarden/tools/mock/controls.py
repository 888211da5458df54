"""Server-wide settings and per-request controls of the mock, with validation.

A test steers one request with headers (``x-mock-<name>``) or query
parameters (``<name>``); the query wins when both are present, so a client
that cannot set headers can still steer, and a proxy test can override a
header a client library adds. Settings supply the defaults. All parsing and
validation lives here, so a bad value becomes one clear 400 message instead
of a half-started stream. Durations are seconds (floats).

Controls (name: meaning, default):

- ``tokens``: tokens in the answer (settings, 40)
- ``tps``: tokens per second; 0 means no pacing (settings, 20)
- ``ttft``: seconds before the first token (settings, 0.2)
- ``fault``: a :class:`~streamwarden.tools.mock.faults.Fault` name, or ``none``
- ``fault-after`` (alias ``stall-after``): tokens written before a cutting
  fault strikes (half the answer)
- ``delay``: seconds for ``stall-before-headers``/``slow-headers`` (30) and,
  when given, how long ``stall`` lasts before the stream resumes (forever)
- ``size``: bytes of the ``giant-event`` event (10 MiB)
- ``status``: HTTP status of ``error-status`` (500); a status of 400 or more
  on a request that names no fault implies ``error-status``
- ``body``: ``0`` makes ``error-status`` answer with an empty body (1)
- ``tool-call``: ``1`` answers with a streamed tool call (every format but
  ollama and generic) (0)
- ``request-id``: the id the mock records and returns in
  ``x-mock-request-id`` (generated)
- ``stamp``: ``1`` starts every event block of a server-sent events stream
  with a comment line holding the wall-clock time the block was written
  (:func:`streamwarden.tools.probe.measure.send_stamp`), for ``streamwarden probe``'s
  per-event path delay; clients ignore comment lines, so the events are
  unchanged (0)
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from streamwarden.tools.mock.faults import DEFAULT_GIANT_EVENT_BYTES, Fault
from streamwarden.tools.mock.formats import wire_format

__all__ = ["ControlError", "Controls", "MockSettings", "parse_controls", "parse_fault"]

# Answers are rendered whole before they are paced out, so both caps bound memory.
_MAX_TOKENS = 100_000
_MAX_EVENT_BYTES = 256 * 1024 * 1024
_MAX_SECONDS = 24 * 3600.0
_MAX_REQUEST_ID = 200
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _fault_names() -> str:
    return ", ".join(f.value for f in Fault)


def parse_fault(value: str | None) -> Fault | None:
    """Return the fault named ``value`` (``None``, ``""`` and ``none`` mean no fault)."""
    if value is None or value.strip().lower() in ("", "none"):
        return None
    try:
        return Fault(value.strip().lower())
    except ValueError:
        raise ControlError(f"unknown fault {value!r} (accepted: {_fault_names()})") from None


class ControlError(ValueError):
    """A setting or per-request control has a bad value (the mock answers 400)."""


@dataclass(frozen=True, slots=True)
class MockSettings:
    """Server-wide defaults of the mock; every field can be overridden per request."""

    dialect: str = "openai-chat"
    """The wire format for paths that no provider format claims (a mock format
    name such as ``openai-chat`` or a dialect alias such as ``vercel-ai``)."""
    tokens_per_second: float = 20.0
    """Generation pace; 0 means no pacing."""
    ttft: float = 0.2
    """Seconds between the response headers and the first token."""
    tokens: int = 40
    """Tokens per answer."""
    fault: str | None = None
    """The fault every request gets unless it names another (or ``none``)."""
    abort_on_disconnect: bool = True
    """An engine that stops generating when its client leaves (vLLM, TGI);
    ``False`` (``--no-abort``) goes on to the end of the answer, as some
    llama.cpp server versions did: tokens nobody will read."""
    engine: str = "vllm"
    """The format of ``GET /metrics``: ``vllm`` or ``sglang``."""

    def __post_init__(self) -> None:
        if self.engine not in ("vllm", "sglang"):
            raise ValueError("engine must be vllm or sglang")
        try:
            wire_format(self.dialect)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        _check_seconds("tokens_per_second", self.tokens_per_second)
        _check_seconds("ttft", self.ttft)
        if not 0 <= self.tokens <= _MAX_TOKENS:
            raise ValueError(f"tokens must be between 0 and {_MAX_TOKENS}")
        try:
            parse_fault(self.fault)
        except ControlError as exc:
            raise ValueError(str(exc)) from None


def _check_seconds(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= _MAX_SECONDS):
        raise ValueError(f"{name} must be a number between 0 and {_MAX_SECONDS:g}")


@dataclass(frozen=True, slots=True)
class Controls:
    """The resolved controls of one request."""

    request_id: str
    tokens: int
    tokens_per_second: float
    ttft: float
    fault: Fault | None
    fault_after: int | None
    """``None`` means half the answer."""
    delay: float | None
    """``None`` means the fault's own default."""
    size: int
    status: int
    error_body: bool
    tool_call: bool
    stamp: bool = False
    """Start each SSE block with its send time (``streamwarden probe``)."""

    def strike_after(self) -> int:
        """Tokens written before a cutting fault strikes."""
        return self.tokens // 2 if self.fault_after is None else self.fault_after


def parse_controls(
    headers: Mapping[str, str], query: Mapping[str, str], settings: MockSettings
) -> Controls:
    """Resolve one request's controls from its (case-insensitive) headers and query.

    Raises :class:`ControlError` naming the control and the bad value.
    """

    def raw(name: str) -> str | None:
        value = query.get(name)
        return value if value is not None else headers.get(f"x-mock-{name}")

    request_id = raw("request-id") or f"mock-{uuid.uuid4().hex[:16]}"
    # The id goes back in a response header, so it must be a safe header value.
    if len(request_id) > _MAX_REQUEST_ID or not all(33 <= ord(c) <= 126 for c in request_id):
        raise ControlError(
            f"bad request-id {request_id[:40]!r}: use up to {_MAX_REQUEST_ID} printable "
            "ASCII characters without spaces"
        )

    fault_given = raw("fault")
    fault = parse_fault(fault_given) if fault_given is not None else parse_fault(settings.fault)
    status = _integer(raw, "status", 500, 100, 599)
    if fault_given is None and raw("status") is not None and status >= 400:
        fault = Fault.ERROR_STATUS

    after_name = "fault-after" if raw("fault-after") is not None else "stall-after"
    delay_text = raw("delay")
    return Controls(
        request_id=request_id,
        tokens=_integer(raw, "tokens", settings.tokens, 0, _MAX_TOKENS),
        tokens_per_second=_seconds(raw, "tps", settings.tokens_per_second),
        ttft=_seconds(raw, "ttft", settings.ttft),
        fault=fault,
        fault_after=(
            _integer(raw, after_name, 0, 0, _MAX_TOKENS) if raw(after_name) is not None else None
        ),
        delay=_seconds(raw, "delay", 0.0) if delay_text is not None else None,
        size=_integer(raw, "size", DEFAULT_GIANT_EVENT_BYTES, 1, _MAX_EVENT_BYTES),
        status=status,
        error_body=_flag(raw, "body", True),
        tool_call=_flag(raw, "tool-call", False),
        stamp=_flag(raw, "stamp", False),
    )


_RawGetter: TypeAlias = Callable[[str], str | None]
"""Looks a control up by name (query first, then header)."""


def _integer(get: _RawGetter, name: str, default: int, low: int, high: int) -> int:
    text = get(name)
    if text is None:
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise ControlError(f"bad {name} {text!r}: expected a whole number") from None
    if not low <= value <= high:
        raise ControlError(f"bad {name} {value}: expected {low} to {high}")
    return value


def _seconds(get: _RawGetter, name: str, default: float) -> float:
    text = get(name)
    if text is None:
        return default
    try:
        value = float(text.strip())
    except ValueError:
        raise ControlError(f"bad {name} {text!r}: expected a number") from None
    if not (math.isfinite(value) and 0 <= value <= _MAX_SECONDS):
        raise ControlError(f"bad {name} {text!r}: expected 0 to {_MAX_SECONDS:g}")
    return value


def _flag(get: _RawGetter, name: str, default: bool) -> bool:
    text = get(name)
    if text is None:
        return default
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ControlError(f"bad {name} {text!r}: expected 1 or 0")
