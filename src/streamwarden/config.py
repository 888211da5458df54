"""One configuration model for both faces: YAML file, environment, flags.

Precedence, lowest to highest: built-in defaults, the YAML file, the
``STREAMWARDEN_<KEY>`` environment variables, command-line flags (or, for
the middleware, keyword options). Every default lives in :class:`Settings`
and nowhere else.

Durations are written ``250ms``, ``15s``, ``2m``, ``1h`` or as a number of
seconds; sizes as ``64KiB``, ``1MiB``, ``1GiB`` (or ``kB``/``MB``/``GB``) or
a number of bytes. Invalid input raises :class:`ConfigError` with one line
naming the key, the value and what was expected.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    model_validator,
)

from streamwarden._native import PURE_PYTHON
from streamwarden.core.dialects import DIALECT_NAMES
from streamwarden.core.filters import (
    BUILTIN_SETS,
    FilterError,
    FilterRule,
    FilterSet,
    compile_filters,
)
from streamwarden.core.headers import redact_url
from streamwarden.core.relay import Limits
from streamwarden.core.toolcalls import DEEPEST as TOOL_ARGUMENTS_DEEPEST
from streamwarden.core.toolcalls import DEPTH as TOOL_ARGUMENTS_DEPTH

__all__ = [
    "CONFIG_FILE_VARIABLE",
    "SIDECAR_ONLY",
    "ConfigError",
    "RouteSettings",
    "Settings",
    "env_variable",
    "format_duration",
    "format_size",
    "key_choices",
    "load_settings",
    "parse_duration",
    "parse_size",
    "settings_table",
    "written_default",
]

ENV_PREFIX = "STREAMWARDEN_"
#: The variable that names the config file: a variable of the process, not a setting.
CONFIG_FILE_VARIABLE = ENV_PREFIX + "CONFIG"


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line for the user."""


#: Settings only the sidecar reads: the listeners, the upstream connection,
#: the HTTP parser's limits, the drain and the event loop are the server's
#: in an ASGI app. The middleware accepts them (one file can configure both
#: faces) and logs a warning for each one it is given as an option.
SIDECAR_ONLY = frozenset(
    {
        "listen",
        "admin_listen",
        "upstream",
        "upstream_ca_bundle",
        "preserve_host",
        "readiness_check_upstream",
        "upstream_connect_timeout",
        "upstream_headers_timeout",
        "upstream_pool_size",
        "upstream_keepalive_timeout",
        "max_request_body_bytes",
        "max_request_line_bytes",
        "max_header_bytes",
        "max_headers",
        "request_header_timeout",
        "max_client_connections",
        "drain_timeout",
        "event_loop",
        "trusted_proxies",
        # The middleware sits in front of the app, not of the provider: the
        # app builds the provider's request itself.
        "usage_injection",
        "usage_injection_max_body_bytes",
    }
)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kib|mib|gib|kb|mb|gb|k|m|g)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    None: 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
}


def parse_duration(value: object) -> float:
    """Seconds from ``15s``, ``250ms``, ``2m``, ``1h`` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("duration")
        return float(value)
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ValueError("duration")


def parse_size(value: object) -> int:
    """Bytes from ``64KiB``, ``1MiB``, ``1GiB`` or a number of bytes."""
    if isinstance(value, bool):
        raise ValueError("size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size")
        return value
    if isinstance(value, str) and (match := _SIZE.match(value)):
        unit = match.group(2).lower() if match.group(2) else None
        return int(float(match.group(1)) * _SIZE_UNITS[unit])
    raise ValueError("size")


def format_duration(seconds: float) -> str:
    """A duration as a user writes it, and :func:`parse_duration` reads it back.

    Hours or minutes when the value is a whole number of two or more of them
    (``30m``, not ``1800s``; ``60s``, not ``1m``), else seconds or
    milliseconds when whole (``15s``, ``250ms``); zero is ``0``.
    """
    if seconds == 0:
        return "0"
    for unit, scale, least in (("h", 3600.0, 2), ("m", 60.0, 2), ("s", 1.0, 1), ("ms", 0.001, 1)):
        count = round(seconds / scale, 6)
        if count >= least and count.is_integer():
            return f"{int(count)}{unit}"
    return f"{seconds:g}s"


def format_size(size: int) -> str:
    """A size as a user writes it, and :func:`parse_size` reads it back: ``8MiB``, ``8190``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _host_port(value: object) -> str:
    if isinstance(value, str):
        host, sep, port = value.rpartition(":")
        if sep and port.isdigit() and 0 <= int(port) <= 65535:
            # ":8080", as other servers take it: every interface.
            return value if host else f"0.0.0.0:{port}"
    raise ValueError("host_port")


def _upstream(value: object) -> str:
    if isinstance(value, str):
        if value.startswith("unix:") and len(value) > 5:
            return value
        match = re.match(r"^(https?)://([^/?#]+)(/[^?#]*)?$", value)
        if match:
            return value.rstrip("/")
    raise ValueError("upstream")


def _http_url(value: object) -> str:
    if isinstance(value, str) and re.match(r"^https?://[^/?#\s]+(/[^\s]*)?$", value):
        return value
    raise ValueError("http_url")


HttpUrl = Annotated[str, BeforeValidator(_http_url)]

#: The least ``max_tool_arguments_bytes``: an open call alone counts 256 bytes,
#: so less would fail every tool call (it has no "off": a call is checked or broken).
TOOL_ARGUMENTS_MIN = 1024


def _tool_arguments_size(value: object) -> int:
    size = parse_size(value)
    if size < TOOL_ARGUMENTS_MIN:
        raise ValueError("tool_arguments_size")
    return size


ToolArgumentsSize = Annotated[int, BeforeValidator(_tool_arguments_size)]
#: ``max_tool_arguments_depth``: a Gemini part's streamed arguments are a list
#: of objects, two levels before any argument; past DEEPEST, ``json`` itself
#: (which recurses) is too near its limit to parse or write them.
ToolArgumentsDepth = Annotated[int, Field(ge=16, le=TOOL_ARGUMENTS_DEEPEST)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
HostPort = Annotated[str, BeforeValidator(_host_port)]
Upstream = Annotated[str, BeforeValidator(_upstream)]


def _readable_file(value: object) -> str:
    if isinstance(value, str) and os.access(value, os.R_OK) and os.path.isfile(value):
        return value
    raise ValueError("readable_file")


ReadableFile = Annotated[str, BeforeValidator(_readable_file)]


def _networks(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part for part in value.replace(",", " ").split() if part]
    if isinstance(value, list | tuple):
        try:
            return tuple(str(ipaddress.ip_network(str(v).strip(), strict=False)) for v in value)
        except ValueError:
            pass
    raise ValueError("networks")


Networks = Annotated[tuple[str, ...], BeforeValidator(_networks)]


def _yaml_off(value: object) -> object:
    # YAML 1.1, which PyYAML reads, takes a bare `off` for false: the word
    # the user wrote is meant.
    return "off" if value is False else value


#: ``auto`` or ``off``, the latter as YAML reads it bare too.
AutoOrOff = Annotated[Literal["auto", "off"], BeforeValidator(_yaml_off)]
#: What happens to the upstream when the client leaves mid-stream.
ClientGonePolicy = Literal["cancel", "detach", "drain"]


def _resume_store(value: object) -> str:
    if isinstance(value, str) and (
        value == "memory" or re.match(r"^rediss?://[^/?#\s]+(/\d+)?$", value)
    ):
        return value
    raise ValueError("resume_store")


ResumeStore = Annotated[str, BeforeValidator(_resume_store)]

#: The shortest ``resume_secret`` taken: 32 characters (of a random token,
#: ``openssl rand -hex 32`` gives 64).
RESUME_SECRET_MIN = 32


def _resume_secret(value: object) -> SecretStr:
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if isinstance(text, str) and (text == "" or len(text) >= RESUME_SECRET_MIN):
        return SecretStr(text)
    raise ValueError("resume_secret")


ResumeSecret = Annotated[SecretStr, BeforeValidator(_resume_secret)]
DialectName = Literal[
    "auto",
    "openai-chat",
    "openai-responses",
    "anthropic",
    "gemini",
    "cohere",
    "vercel-ai",
    "ndjson",
    "generic",
    "tgi",
]
assert set(DialectName.__args__) == set(DIALECT_NAMES)  # type: ignore[attr-defined]

# What each custom validator expects, for the one-line error message.
_EXPECTED = {
    "duration": "is not a duration (e.g. 15s, 250ms, 2m)",
    "size": "is not a size (e.g. 64KiB, 8MiB, 1GiB)",
    "host_port": "is not HOST:PORT (e.g. 0.0.0.0:8080)",
    "upstream": "is not an upstream URL (http://host:port, https://host:port or unix:/path.sock)",
    "readable_file": "is not a readable file",
    "networks": "is not a list of networks (e.g. 10.0.0.0/8, 127.0.0.1)",
    "resume_store": "is not a resume store (memory or redis://host:port/db)",
    "resume_secret": f"must be at least {RESUME_SECRET_MIN} characters, or unset",
    "http_url": "is not an http(s) URL (e.g. http://127.0.0.1:8000/metrics)",
    "tool_arguments_size": "must be a size of at least 1KiB (an open tool call counts 256 bytes)",
}


# Keys whose value is never shown, not even in an error about it.
_SECRET_KEYS = frozenset({"resume_secret"})

# The prefix of a filter's own error, shown after its place (output_filters.2).
_FILTER_ERROR = "output filter: "


class OutputFilter(BaseModel):
    """One entry of ``output_filters``: what to look for, and what to do when it is found."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: A built-in set: ``secrets`` (API keys and tokens, private key headers)
    #: or ``cards`` (Luhn-checked card numbers).
    builtin: str | None = None
    #: A literal string, matched exactly (case included).
    literal: str | None = None
    #: A regular expression (the ``regex`` module's syntax) of a bounded match length.
    regex: str | None = None
    #: ``redact``: the match becomes ``[redacted]``; ``block``: the stream ends
    #: with ``content_blocked``.
    action: Literal["redact", "block"]
    #: The filter's name in metrics (default: the set's name, ``literal`` or ``regex``).
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    #: The longest match of a regex whose own length is unbounded (+, *).
    max_length: int | None = None

    @model_validator(mode="after")
    def _compiles(self) -> OutputFilter:
        given = [k for k in ("builtin", "literal", "regex") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(_FILTER_ERROR + "give exactly one of builtin, literal or regex")
        if self.builtin is not None and self.builtin not in BUILTIN_SETS:
            names = ", ".join(BUILTIN_SETS)
            raise ValueError(
                f"{_FILTER_ERROR}builtin {self.builtin!r} is not a built-in set (one of {names})"
            )
        if self.max_length is not None and self.regex is None:
            raise ValueError(_FILTER_ERROR + "max_length applies to a regex only")
        try:
            compile_filters((self.rule(),), False)
        except FilterError as exc:
            raise ValueError(f"{_FILTER_ERROR}{given[0]} {exc}") from None
        return self

    def rule(self) -> FilterRule:
        """The entry as the filters take it."""
        kind: Literal["builtin", "literal", "regex"]
        if self.builtin is not None:
            kind, value = "builtin", self.builtin
        elif self.literal is not None:
            kind, value = "literal", self.literal
        else:
            kind, value = "regex", self.regex or ""
        default_name = value if kind == "builtin" else kind  # never the literal itself
        return FilterRule(kind, value, self.action, self.name or default_name, self.max_length)


@lru_cache(maxsize=64)
def _route_filters(entries: tuple[OutputFilter, ...], tool_arguments: bool) -> FilterSet | None:
    """A route's compiled filters: once per distinct list, not per request."""
    return compile_filters(tuple(e.rule() for e in entries), tool_arguments)


class RouteSettings(BaseModel):
    """Overrides of the per-stream settings for requests under one path prefix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keepalive_interval: Duration | None = None
    upstream_idle_timeout: Duration | None = None
    max_stream_duration: Duration | None = None
    client_write_timeout: Duration | None = None
    max_event_bytes: Size | None = None
    max_tool_arguments_bytes: ToolArgumentsSize | None = None
    max_tool_arguments_depth: ToolArgumentsDepth | None = None
    dialect: DialectName | None = None
    early_headers_after: Duration | None = None
    on_client_gone: ClientGonePolicy | None = None
    resume_window: Duration | None = None
    usage_injection: AutoOrOff | None = None
    output_filters: tuple[OutputFilter, ...] | None = None
    output_filter_tool_arguments: bool | None = None


class Settings(BaseModel):
    """Every setting, with its default. Both faces read this model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Address of the proxy listener.
    listen: HostPort = "0.0.0.0:8080"
    #: Address of the admin listener (/metrics, /healthz, /readyz).
    admin_listen: HostPort = "0.0.0.0:9090"
    #: The one upstream every request goes to, ``http(s)://host:port`` or
    #: ``unix:/path.sock``; required for ``run``.
    upstream: Upstream | None = None
    #: A CA bundle (PEM) to verify an https upstream with, instead of the system's.
    upstream_ca_bundle: ReadableFile | None = None
    #: Send the client's Host header to the upstream instead of the upstream's own.
    preserve_host: bool = False
    #: Quiet time before a keep-alive comment is written to the client.
    keepalive_interval: Duration = 15.0
    #: Make /readyz also check that the upstream accepts connections.
    readiness_check_upstream: bool = False
    #: Time to connect to the upstream.
    upstream_connect_timeout: Duration = 10.0
    #: Idle upstream connections kept for reuse, at most.
    upstream_pool_size: int = Field(default=256, ge=0)
    #: How long an idle upstream connection is kept before it is closed.
    upstream_keepalive_timeout: Duration = 15.0
    #: Time to wait for the upstream's response headers (0: no limit).
    upstream_headers_timeout: Duration = 0.0
    #: Mid-stream time without any upstream byte before the stream is failed
    #: with ``upstream_timeout``.
    upstream_idle_timeout: Duration = 60.0
    #: Longest a stream may run: past it, ``duration_exceeded``.
    max_stream_duration: Duration = 1800.0
    #: Longest the client may take to accept a write before it is cut
    #: (end state ``client_too_slow``).
    client_write_timeout: Duration = 30.0
    #: Largest raw size of one event: past it, ``event_too_large``.
    max_event_bytes: Size = 8 * 1024 * 1024
    #: Most bytes of tool-call arguments held at once per stream, to check
    #: each call's arguments whole at its close (the calls open together;
    #: each counts 256 bytes more, and its id): past it, ``tool_call_too_large``.
    #: At least 1KiB.
    max_tool_arguments_bytes: ToolArgumentsSize = 1024 * 1024
    #: Most levels of objects and arrays in one tool call's arguments,
    #: measured before anything parses or writes them again: deeper,
    #: ``tool_call_too_large``. From 16 to 512.
    max_tool_arguments_depth: ToolArgumentsDepth = TOOL_ARGUMENTS_DEPTH
    #: Largest request body forwarded upstream: past it, 413.
    max_request_body_bytes: Size = 64 * 1024 * 1024
    #: Longest request line (method, target, version) before a 414.
    max_request_line_bytes: Size = 8190
    #: Longest request header line before a 431.
    max_header_bytes: Size = 8190
    #: Most request headers before a 431.
    max_headers: int = Field(default=100, ge=1)
    #: Time for a client to send its whole request head before a 408 (0: none).
    request_header_timeout: Duration = 10.0
    #: Streams open at once before new ones get 503 with ``Retry-After`` (0:
    #: unlimited). A stream read on after its client left (``drain``,
    #: ``detach``) counts until it ends; a resume of a stream still running
    #: here shares that stream's place.
    max_concurrent_streams: int = Field(default=0, ge=0)
    #: Client connections open at once on the proxy port, idle ones included,
    #: and streams read on after their client left (each keeps its upstream
    #: connection); past it a new connection is answered 503 and closed at
    #: once, so that the admin port and the upstreams always have
    #: descriptors. 0: as many as the open-files limit fits, two descriptors
    #: each (a client and its upstream) after a reserve (sidecar).
    max_client_connections: int = Field(default=0, ge=0)
    #: Grace period for streams in flight on SIGTERM.
    drain_timeout: Duration = 25.0
    #: The stream's wire format, or ``auto`` to detect it.
    dialect: DialectName = "auto"
    #: Commit ``200 text/event-stream`` and keep the client alive if the
    #: upstream has not answered a streaming request after this long (0: off).
    early_headers_after: Duration = 0.0
    #: When the client leaves mid-stream: ``cancel`` closes the upstream at
    #: once (the inference server aborts); ``detach`` runs it on for
    #: ``resume_window``, its events kept for a resume (``Last-Event-ID``);
    #: ``drain`` reads it to its end, writing nothing, so its final usage is
    #: metered. In the middleware, "the upstream" is the app's generator.
    on_client_gone: ClientGonePolicy = "cancel"
    #: ``detach``: how long a stream runs on after its client left, waiting
    #: for a resume, before the upstream is closed (``detached_expired``).
    resume_window: Duration = 30.0
    #: Where resumable streams are kept: ``memory`` (this process) or
    #: ``redis://host:port/db`` (shared by every replica).
    resume_store: ResumeStore = "memory"
    #: How long a resumable stream is kept after it ended.
    resume_ttl: Duration = 600.0
    #: Most bytes kept per resumable stream (its oldest events go first).
    resume_max_bytes: Size = 4 * 1024 * 1024
    #: Most bytes the memory store keeps for all streams.
    resume_max_total_bytes: Size = 256 * 1024 * 1024
    #: More request headers, besides the built-in credential ones, whose
    #: values make the owner of a resumable stream.
    resume_owner_headers: tuple[str, ...] = ()
    #: More query parameters, besides the built-in credential ones (Gemini's
    #: ``key``...), whose values make the owner of a resumable stream.
    resume_owner_query_params: tuple[str, ...] = ()
    #: A secret that keys each stream's owner digest (with its stream id), so
    #: that whoever can read or write the resume store cannot test guessed
    #: credentials against it nor forge an owner. Give it to every replica
    #: (``STREAMWARDEN_RESUME_SECRET``, from a Kubernetes Secret); never logged.
    resume_secret: ResumeSecret = SecretStr("")
    #: ``auto``: ask an OpenAI-chat upstream for usage (``stream_options.
    #: include_usage``) on streams whose client did not, and take what that
    #: adds back out of the client's stream: exact token counts, unchanged
    #: bytes (sidecar; per route). Off by default: it assumes the upstream
    #: answers two requests of one kind (target, host, model, credentials)
    #: alike, which a gateway routing on anything else breaks.
    usage_injection: AutoOrOff = "off"
    #: Largest request body usage injection rewrites; larger ones go unchanged.
    usage_injection_max_body_bytes: Size = 1024 * 1024
    #: What must never reach a reader: literals, bounded regexes, the built-in
    #: ``secrets`` and ``cards`` sets, each redacted or blocked (per route).
    output_filters: tuple[OutputFilter, ...] = ()
    #: Output filters also read tool-call arguments, not only the answer's text.
    output_filter_tool_arguments: bool = False
    #: The inference engine's Prometheus endpoint, to reconcile its generated
    #: tokens with the sidecar's and time its aborts (none: off).
    engine_metrics_url: HttpUrl | None = None
    #: Whose metric names to read there (``auto``: whichever are present).
    engine: Literal["auto", "vllm", "sglang", "tgi", "llamacpp"] = "auto"
    #: How often the engine is scraped.
    engine_scrape_interval: Duration = 5.0
    #: OpenTelemetry: a span per request with the GenAI conventions, and the
    #: GenAI metrics, exported over OTLP (the ``otel`` extra); the standard
    #: ``OTEL_*`` variables apply.
    otel_exporter: Literal["none", "otlp-http", "otlp-grpc"] = "none"
    #: Put the request's model name in ``gen_ai.request.model`` (a user's
    #: choice of model can be sensitive; off by default).
    otel_record_models: bool = False
    #: More media types to treat as event streams.
    stream_media_types: tuple[str, ...] = ()
    #: Peers (CIDRs) whose X-Forwarded-For, Forwarded and X-Real-IP are kept;
    #: from anyone else they are replaced by what the sidecar saw.
    trusted_proxies: Networks = ()
    #: Header names, besides the built-in secret ones, to redact in logs.
    redact_headers: tuple[str, ...] = ()
    #: Per path prefix overrides; the longest matching prefix wins.
    routes: dict[str, RouteSettings] = Field(default_factory=dict)
    #: Middleware only: serve the Prometheus metrics at this path of the app.
    metrics_path: str | None = None
    #: One JSON object a line, or ``key=value`` text (what the demo prints).
    log_format: Literal["json", "text"] = "json"
    #: The least level logged.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: Sidecar only: the event loop. ``auto`` takes uvloop when it is installed
    #: (the ``fast`` extra, and the container image): it carries about a
    #: quarter more events per second at the same latency (bench/README.md).
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"

    def for_path(self, path: str) -> ResolvedRoute:
        """The per-stream settings for a request path, route overrides applied."""
        best = ""
        for prefix in self.routes:
            if path.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        override = self.routes.get(best) if best else None

        def pick(name: str) -> Any:
            value = getattr(override, name) if override is not None else None
            return getattr(self, name) if value is None else value

        return ResolvedRoute(
            route=best or "/",
            dialect=pick("dialect"),
            limits=Limits(
                keepalive_interval=pick("keepalive_interval"),
                upstream_idle_timeout=pick("upstream_idle_timeout"),
                max_stream_duration=pick("max_stream_duration"),
                max_event_bytes=pick("max_event_bytes"),
                max_tool_arguments_bytes=pick("max_tool_arguments_bytes"),
                max_tool_arguments_depth=pick("max_tool_arguments_depth"),
            ),
            client_write_timeout=pick("client_write_timeout"),
            early_headers_after=pick("early_headers_after"),
            on_client_gone=pick("on_client_gone"),
            resume_window=pick("resume_window"),
            usage_injection=pick("usage_injection"),
            output_filters=_route_filters(
                pick("output_filters"), pick("output_filter_tool_arguments")
            )
            if pick("output_filters")
            else None,
        )


@dataclass(frozen=True, slots=True)
class ResolvedRoute:
    """The settings that apply to one request."""

    #: The matched route prefix ("/" when none matched): the metrics label.
    route: str
    dialect: str
    limits: Limits
    client_write_timeout: float
    early_headers_after: float
    on_client_gone: str = "cancel"
    resume_window: float = 30.0
    usage_injection: str = "off"
    #: The route's compiled output filters (``None``: none, and no cost).
    output_filters: FilterSet | None = None

    @property
    def resumable(self) -> bool:
        """Streams on this route get event ids and are kept for a resume."""
        return self.on_client_gone == "detach"


_KEYS = tuple(Settings.model_fields)


def env_variable(key: str) -> str:
    """The environment variable of a setting: ``STREAMWARDEN_<KEY>``."""
    return ENV_PREFIX + key.upper()


@lru_cache(maxsize=1)
def _defaults() -> Settings:
    return Settings()


def _read_by(key: str, parse: Any) -> bool:
    """Whether a setting's values are read by ``parse`` (its type's validator)."""
    return any(
        isinstance(part, BeforeValidator) and part.func is parse
        for part in Settings.model_fields[key].metadata
    )


def written_default(key: str) -> str:
    """A setting's default as a user writes it: ``15s``, ``8MiB``, ``false``, ``[]``.

    The model's own default, shown the way the file and the variable take it;
    ``unset`` when it has no value.
    """
    value = getattr(_defaults(), key)
    if value is None or (isinstance(value, SecretStr) and not value.get_secret_value()):
        return "unset"
    if isinstance(value, SecretStr):
        return "(hidden)"
    if _read_by(key, parse_duration):
        return format_duration(value)
    if _read_by(key, parse_size) or _read_by(key, _tool_arguments_size):
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return json.dumps(list(value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def key_choices(key: str) -> tuple[str, ...] | None:
    """The values a setting takes when they are a fixed set (``log_level``), else ``None``."""
    annotation = Settings.model_fields[key].annotation
    if get_origin(annotation) is Literal:
        return tuple(str(choice) for choice in get_args(annotation))
    return None


def _format_error(error: Mapping[str, Any], model: type[BaseModel]) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ()))
    value = error.get("input")
    if isinstance(value, str) and "://" in value:
        value = redact_url(value)  # a URL's password or query key never goes into the line
    shown = json.dumps(value) if isinstance(value, str | int | float | bool) else repr(value)
    if loc.rpartition(".")[2] in _SECRET_KEYS:
        shown = "(the value given)"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        name = str(error["loc"][-1]) if error.get("loc") else loc
        per_route = "routes" in loc
        if per_route and name in Settings.model_fields:
            allowed = ", ".join(RouteSettings.model_fields)
            return f'{loc}: "{name}" cannot be set per route (a route may set: {allowed})'
        fields = list(RouteSettings.model_fields if per_route else model.model_fields)
        guess = difflib.get_close_matches(name, fields, n=1)
        hint = f' (did you mean "{guess[0]}"?)' if guess else ""
        return f'{loc}: unknown key "{name}"{hint}'
    ctx = error.get("ctx") or {}
    message = str(ctx.get("error", "")) if kind == "value_error" else ""
    if message.startswith(_FILTER_ERROR):
        return f"{loc}: {message}"
    if kind == "missing":
        return f"{loc}: is required"
    if message in _EXPECTED:
        return f"{loc}: {shown} {_EXPECTED[message]}"
    if kind == "literal_error":
        return f"{loc}: {shown} is not one of {ctx.get('expected', '')}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"{loc}: {shown} is not an integer"
    if kind in ("bool_parsing", "bool_type"):
        return f"{loc}: {shown} is not true or false"
    if kind == "greater_than_equal":
        return f"{loc}: {shown} must be at least {ctx.get('ge')}"
    if kind == "less_than_equal":
        return f"{loc}: {shown} must be at most {ctx.get('le')}"
    return f"{loc}: {shown}: {error.get('msg', 'invalid value')}"


def _validate(data: Mapping[str, Any]) -> Settings:
    try:
        return Settings.model_validate(dict(data))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(_format_error(first, Settings)) from None


def config_problems(data: Mapping[str, Any]) -> list[str]:
    """Every problem of a set of keys, one line each (none: valid)."""
    try:
        Settings.model_validate(dict(data))
    except ValidationError as exc:
        return [_format_error(error, Settings) for error in exc.errors()]
    return []


class _DuplicateKey(ValueError):
    """A mapping names the same key twice (the last one would silently win)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise _DuplicateKey(f'line {line}: "{key}" is given twice')
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a YAML config file as a mapping of keys, or raise :class:`ConfigError`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no tags run code
    except _DuplicateKey as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r}:{where} is not valid YAML") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping of keys")
    return loaded


# Kubernetes injects "service link" variables for every Service in the
# namespace: a Service named streamwarden gives STREAMWARDEN_PORT,
# STREAMWARDEN_SERVICE_HOST, STREAMWARDEN_PORT_8080_TCP_ADDR, ... They are not
# settings, and failing on them would crash-loop the pod.
_SERVICE_LINK = re.compile(
    r"(_SERVICE_HOST|_SERVICE_PORT(_\w+)?|_PORT|_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)$"
)


#: Variables of the process, not settings: the config file's path, and
#: whether the per-event modules run from source.
_NOT_SETTINGS = frozenset({CONFIG_FILE_VARIABLE, PURE_PYTHON})


def environment_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``STREAMWARDEN_<KEY>`` variables as config keys (values still raw strings)."""
    found: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in _KEYS and _SERVICE_LINK.search(name):
            continue
        if key not in _KEYS:
            guess = difflib.get_close_matches(key, _KEYS, n=1)
            hint = f' (did you mean "{env_variable(guess[0])}"?)' if guess else ""
            raise ConfigError(f'environment: unknown variable "{name}"{hint}')
        if key in (
            "routes",
            "stream_media_types",
            "redact_headers",
            "resume_owner_headers",
            "resume_owner_query_params",
            "output_filters",
            "trusted_proxies",  # also "10.0.0.0/8, ::1", which YAML reads as that string
        ):
            try:
                # An empty variable stays "" (trusted_proxies: no networks), not YAML's null.
                found[key] = yaml.safe_load(value) if value.strip() else value
            except yaml.YAMLError:
                raise ConfigError(f"{name}: {value!r} is not valid YAML") from None
        else:
            found[key] = value
    return found


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings: defaults < file < environment < ``overrides`` (flags, options).

    ``config_file`` defaults to ``$STREAMWARDEN_CONFIG`` when set.
    """
    env = os.environ if environ is None else environ
    if config_file is None:
        config_file = env.get(CONFIG_FILE_VARIABLE) or None
    data: dict[str, Any] = {}
    if config_file is not None:
        data.update(read_config_file(config_file))
    data.update(environment_overrides(env))
    if overrides:
        data.update({k: v for k, v in overrides.items() if v is not None})
    return _validate(data)


def _setting_docs() -> dict[str, str]:
    """Each setting's ``#:`` comment in :class:`Settings`' source: what it does, in one place."""
    import inspect

    docs: dict[str, str] = {}
    comment: list[str] = []
    for line in inspect.getsource(Settings).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
            continue
        name = stripped.partition(":")[0]
        if comment and name in Settings.model_fields:
            docs[name] = " ".join(comment)
        comment = []
    return docs


def _kind(key: str) -> str:
    """What a setting's value is, as the reference names it: its unit, or its choices."""
    choices = key_choices(key)
    if choices is not None:
        return " \\| ".join(f"`{choice}`" for choice in choices)
    if _read_by(key, parse_duration):
        return "duration"
    if _read_by(key, parse_size) or _read_by(key, _tool_arguments_size):
        return "size (bytes)"
    for parse, kind in _KINDS:
        if _read_by(key, parse):
            return kind
    value = getattr(_defaults(), key)
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "count"
    if isinstance(value, tuple):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return "text"


#: The values read by a validator of their own, as the reference names them.
_KINDS: tuple[tuple[Any, str], ...] = (
    (_host_port, "host:port"),
    (_upstream, "URL"),
    (_http_url, "URL"),
    (_resume_store, "`memory` or URL"),
    (_readable_file, "file path"),
    (_networks, "list of CIDRs"),
    (_resume_secret, "secret"),
)


def settings_table() -> str:
    """The configuration reference: every key, its variable, default, unit and job (Markdown).

    Made from :class:`Settings` (its fields, defaults and ``#:`` comments),
    :class:`RouteSettings` and :data:`SIDECAR_ONLY`, so it is never kept by
    hand; ``python -m streamwarden.tools.reference --write`` puts it into
    ``docs/reference/configuration.md``.
    """
    docs = _setting_docs()
    rows = [
        "| key | environment variable | default | value | what it does |",
        "|---|---|---|---|---|",
    ]
    for key in Settings.model_fields:
        text = re.sub(r"``([^`]+)``", r"`\1`", docs.get(key, ""))
        marks = (("per route", key in RouteSettings.model_fields), ("sidecar", key in SIDECAR_ONLY))
        where = [mark for mark, on in marks if on and mark not in text]
        if where:
            text += f" ({', '.join(where)})"
        text = text.replace("|", "\\|")  # a pipe inside a cell would end it
        default = written_default(key)
        rows.append(f"| `{key}` | `{env_variable(key)}` | `{default}` | {_kind(key)} | {text} |")
    return "\n".join(rows) + "\n"
