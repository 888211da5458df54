"""What ``streamwarden probe`` saw on the path, and what it means (sans-I/O).

The probe's network face (:mod:`streamwarden.tools.probe.client`) sends one
streaming request and hands this module a :class:`Capture`: the status and
headers, every network read of the body with its arrival time (monotonic
seconds since the request went out), and how the body ended. :func:`analyse`
inflates the body if a hop compressed it (bounded, :mod:`streamwarden.core.inflate`),
cuts it into events with the project's own framer (:mod:`streamwarden.core.sse`),
tells the dialect and its terminal event with :mod:`streamwarden.core.dialects`,
and gives a :class:`Report`: when each event arrived and in which read, the
longest silence, the keep-alives, the ending, and one :class:`Verdict` per
symptom, each with its evidence and the usual fix. Nothing here reads a
clock or a socket, so every verdict is tested on made-up captures as well as
on real paths.

When the far end is ``streamwarden mock-upstream`` (asked with the
``x-mock-stamp: 1`` control, which survives any proxy that forwards
headers), each SSE block starts with a comment line holding the wall-clock
time it was written (:func:`send_stamp`); clients ignore comment lines, so
the events themselves are unchanged. Arrival minus send time is then each
event's exact delay in the path, on one host; across hosts it also holds
the two clocks' offset (keep both on NTP, and read a negative delay as clock
skew). Buffering is judged on those delays when they are there (an event
held is one that waited in the path well beyond the quickest one), and on
arrival patterns alone otherwise (events arriving several to a read, with
silences between the reads).

Symptoms and their thresholds are constants below, each with its reason.
``missing no-buffering headers`` is a risk, not a failure that was seen:
it is reported but does not make the probe fail on its own.
"""

from __future__ import annotations

import enum
import itertools
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamwarden.core.dialects import (
    Detection,
    detect,
    sniff,
    stream_framing,
)
from streamwarden.core.dialects.base import Dialect
from streamwarden.core.inflate import InflateError, Inflater
from streamwarden.core.plan import Encoding, response_encoding
from streamwarden.core.sse import EventTooLarge, Frame, LineFramer, SSEFramer

__all__ = [
    "STAMP_PREFIX",
    "STREAMING_HEADERS",
    "Capture",
    "Ending",
    "EventArrival",
    "Finding",
    "Read",
    "Report",
    "Symptom",
    "Verdict",
    "analyse",
    "read_stamp",
    "render_text",
    "report_json",
    "send_stamp",
]

#: The comment line that starts a stamped block: ``: streamwarden-sent <unix seconds>``.
STAMP_PREFIX = b": streamwarden-sent "

#: The response headers that decide whether a stream streams, shown in the report.
STREAMING_HEADERS = (
    "Content-Type",
    "Cache-Control",
    "X-Accel-Buffering",
    "Content-Encoding",
    "Content-Length",
    "Transfer-Encoding",
    "Connection",
    "Server",
    "Via",
    # CDNs and load balancers name themselves here.
    "CF-Ray",
    "CF-Cache-Status",
    "X-Cache",
    "X-Served-By",
    "X-Amz-Cf-Id",
    "X-Azure-Ref",
    "Fly-Request-Id",
    "X-Vercel-Id",
)

#: An event that waited this long in the path beyond the quickest event was held.
#: Far above loopback and LAN jitter, far below what a buffering hop holds
#: (until 4-8 KiB or the whole answer is in, seconds at token pace).
HELD_SECONDS = 0.2
#: Buffered when at least this share of the events was held (a brief stall
#: of a loaded machine holds a few events; a buffering hop holds most).
HELD_SHARE = 0.5
#: Without send times: a read carrying this many events is a lump ...
LUMP_EVENTS = 3
#: ... and lumps separated by silences this long mean a hop released them in batches.
LUMP_GAP_SECONDS = 0.15
#: Without send times: every event within this long, after waiting this long
#: from the request, is an answer held whole. (A model faster than about 100
#: events a second would look the same: send times settle it.)
ALL_AT_ONCE_SECONDS = 0.05
ALL_AT_ONCE_WAIT_SECONDS = 0.5
#: Fewer events than this say nothing about buffering.
MIN_EVENTS_FOR_BUFFERING = 4
#: A silence this long with no keep-alive means the path gets none (the
#: sidecar's default ``keepalive_interval``, and sse-starlette's ping).
KEEPALIVE_EXPECTED_SECONDS = 15.0
#: A stream that ends without its terminal event after a silence this long
#: (and much longer than its usual gap) was cut by an idle timer. nginx's
#: timers run on a cached clock: a 1 s ``proxy_read_timeout`` cuts after 0.9 s.
IDLE_CUT_MIN_SECONDS = 0.5
IDLE_CUT_GAP_FACTOR = 5.0
#: A pause of this share of ``--stall`` is the asked one (timers and pacing round).
STALL_SEEN_SHARE = 0.8
#: A negative delay past this is the two clocks' offset, not rounding.
CLOCK_SKEW_SECONDS = 0.005
#: Inflated bytes per step: a hostile hop's gzip bomb costs this much at a time.
_INFLATE_STEP = 256 * 1024
#: In-band error events kept for the report, and how much of each.
_KEPT_ERRORS = 5
_ERROR_TEXT = 300
#: Events listed one by one in the text report; the rest are summarised.
_LISTED_HEAD = 20
_LISTED_TAIL = 10


def send_stamp(wall_seconds: float) -> bytes:
    """The comment line that starts a block written at ``wall_seconds`` (Unix time)."""
    return STAMP_PREFIX + b"%.6f\n" % wall_seconds


def read_stamp(raw: bytes) -> float | None:
    """The send time a block's raw bytes start with, or ``None``."""
    if not raw.startswith(STAMP_PREFIX):
        return None
    end = raw.find(b"\n", len(STAMP_PREFIX))
    try:
        return float(raw[len(STAMP_PREFIX) : end if end != -1 else None].strip())
    except ValueError:
        return None


class Ending(enum.StrEnum):
    """How the response body ended, as the probe's connection saw it."""

    COMPLETE = "complete"
    """The body ended cleanly (chunked terminator, full length, or close when read-to-close)."""
    BROKEN = "broken"
    """The connection was closed or reset mid-body, or the framing broke."""
    GAVE_UP = "gave-up"
    """The probe stopped reading: ``--max-time`` ran out."""
    TOO_LARGE = "too-large"
    """The probe stopped reading: ``--max-bytes`` were read."""


@dataclass(frozen=True, slots=True)
class Read:
    """One network read of the body: its arrival and its bytes (de-chunked, still coded)."""

    at: float
    data: bytes


@dataclass(frozen=True, slots=True)
class Capture:
    """Everything the network face saw, times in seconds since the request was sent."""

    status: int
    headers: tuple[tuple[str, str], ...]
    headers_at: float
    reads: tuple[Read, ...]
    ending: Ending
    ended_at: float
    #: The wall-clock time (Unix seconds) at which the request was sent.
    started_wall: float
    #: The request path, for dialect detection.
    path: str = "/v1/chat/completions"
    #: The ``--dialect`` setting (``auto`` detects).
    dialect: str = "auto"
    #: The silence the far end was asked for (``--stall``), in seconds.
    stall: float | None = None
    #: Why the body broke, when it did.
    error: str | None = None
    #: The largest event the framer accepts.
    max_event_bytes: int = 8 * 1024 * 1024
    #: The most body bytes decoded (after inflation), as ``--max-bytes``.
    max_bytes: int = 16 * 1024 * 1024
    #: The most events kept, as ``--max-events``.
    max_events: int = 100_000


@dataclass(frozen=True, slots=True)
class EventArrival:
    """One event as it arrived."""

    index: int
    at: float
    read: int
    name: str
    sent_wall: float | None
    #: Seconds the event spent in the path (arrival minus send), when stamped.
    delay: float | None
    terminal: bool


class Finding(enum.StrEnum):
    FOUND = "found"
    CLEAR = "clear"
    UNTESTED = "untested"


class Symptom(enum.StrEnum):
    NOT_A_STREAM = "not-a-stream"
    BUFFERED = "buffered"
    COMPRESSED = "compressed"
    NO_KEEPALIVES = "no-keepalives"
    IDLE_CUT = "idle-cut"
    TRUNCATED = "truncated"
    MISSING_HEADERS = "missing-no-buffering-headers"


#: Symptoms that are risks rather than failures seen: reported, never failing alone.
_ADVISORY = frozenset({Symptom.MISSING_HEADERS})


@dataclass(frozen=True, slots=True)
class Verdict:
    symptom: Symptom
    finding: Finding
    evidence: str
    fix: str = ""

    @property
    def fails(self) -> bool:
        """Whether this verdict makes the probe exit 1."""
        return self.finding is Finding.FOUND and self.symptom not in _ADVISORY


@dataclass(slots=True)
class Report:
    """What the probe measured and concluded."""

    status: int
    headers: list[tuple[str, str]]
    headers_at: float
    dialect: str
    terminal_event: str
    ending: Ending
    ended_at: float
    error: str | None
    first_byte_at: float | None
    first_event_at: float | None
    reads: int
    body_bytes: int
    events: list[EventArrival]
    events_per_read: dict[int, int]
    longest_silence: float
    longest_silence_from: float
    keepalives: int
    keepalive_times: list[float]
    terminal_seen: bool
    stall: float | None
    #: The wall-clock time (Unix seconds) at which the request was sent.
    started_wall: float = 0.0
    #: ``sse`` or ``lines`` (NDJSON, the Vercel data stream: no comment lines, no stamps).
    framing: str = "sse"
    #: False when a bound (or a broken compressed body) stopped the decoding early.
    decoded_whole: bool = True
    #: The data of in-band error events (a provider's, or streamwarden's synthesized ones).
    error_events: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def stamped(self) -> bool:
        return any(event.sent_wall is not None for event in self.events)

    @property
    def fails(self) -> bool:
        return any(verdict.fails for verdict in self.verdicts)

    def streaming_headers(self) -> list[tuple[str, str]]:
        """The response headers that decide streaming, in :data:`STREAMING_HEADERS` order."""
        wanted = {name.lower(): name for name in STREAMING_HEADERS}
        found = [(n, v) for n, v in self.headers if n.lower() in wanted]
        order = {name.lower(): i for i, name in enumerate(STREAMING_HEADERS)}
        return sorted(found, key=lambda pair: order[pair[0].lower()])

    def header(self, name: str) -> str | None:
        values = [v for n, v in self.headers if n.lower() == name.lower()]
        return ", ".join(values) if values else None

    def delays(self) -> list[float]:
        return [e.delay for e in self.events if e.delay is not None]


# -- the analysis ------------------------------------------------------------------


class _Lookup:
    """Case-insensitive header lookup, as :func:`stream_framing` wants."""

    def __init__(self, headers: Sequence[tuple[str, str]]) -> None:
        self._map: dict[str, str] = {}
        for name, value in headers:
            key = name.lower()
            self._map[key] = f"{self._map[key]}, {value}" if key in self._map else value

    def get(self, name: str) -> str | None:
        return self._map.get(name.lower())

    def mapping(self) -> dict[str, str]:
        return dict(self._map)


def analyse(capture: Capture) -> Report:
    """Decode a capture's events and judge each symptom."""
    headers = _Lookup(capture.headers)
    content_type = headers.get("content-type")
    lowered = headers.mapping()
    framing = stream_framing(content_type, lowered)
    detection = detect(
        capture.dialect,
        path=capture.path,
        content_type=content_type,
        headers=lowered,
        framing=framing,
    )
    report = Report(
        status=capture.status,
        headers=list(capture.headers),
        headers_at=capture.headers_at,
        dialect=detection.dialect.name,
        terminal_event=detection.dialect.terminal_event,
        ending=capture.ending,
        ended_at=capture.ended_at,
        error=capture.error,
        first_byte_at=next((read.at for read in capture.reads if read.data), None),
        first_event_at=None,
        reads=len(capture.reads),
        body_bytes=sum(len(read.data) for read in capture.reads),
        events=[],
        events_per_read={},
        longest_silence=0.0,
        longest_silence_from=capture.headers_at,
        keepalives=0,
        keepalive_times=[],
        terminal_seen=False,
        stall=capture.stall,
        started_wall=capture.started_wall,
        framing=framing or "sse",
    )
    dialect = _decode(capture, report, detection, framing or "sse")
    report.dialect = dialect.name
    report.terminal_event = dialect.terminal_event
    _silences(capture, report)
    delays = report.delays()
    if delays and min(delays) < -CLOCK_SKEW_SECONDS:
        report.notes.append(
            f"an event arrived {_seconds(-min(delays))} before it was sent: the far end's clock "
            "is ahead of this one (NTP?); the delays hold that offset"
        )
    report.verdicts = _verdicts(capture, report, dialect, framing is not None)
    return report


def _decode(capture: Capture, report: Report, detection: Detection, framing: str) -> Dialect:
    """Fill the report's events and keep-alives; return the dialect the stream revealed."""
    encoding = response_encoding(_Lookup(capture.headers).get("content-encoding"))
    if encoding is None:
        report.notes.append(
            "the body's Content-Encoding is not one the probe inflates (gzip, deflate): "
            "its events could not be read"
        )
        report.decoded_whole = False
        return detection.dialect
    decoder = _Decoder(capture, report, detection, framing, encoding)
    for number, read in enumerate(capture.reads, start=1):
        if not decoder.feed(number, read):
            report.decoded_whole = False
            break
    count: dict[int, int] = {}
    for events in decoder.per_read.values():
        count[events] = count.get(events, 0) + 1
    report.events_per_read = dict(sorted(count.items()))
    return decoder.dialect


class _Decoder:
    """Reads in, events and keep-alives out into the report, within the capture's bounds."""

    def __init__(
        self,
        capture: Capture,
        report: Report,
        detection: Detection,
        framing: str,
        encoding: Encoding,
    ) -> None:
        self._capture = capture
        self._report = report
        self._inflater = Inflater(encoding) if encoding != "identity" else None
        self._framer: SSEFramer | LineFramer = (
            SSEFramer(capture.max_event_bytes)
            if framing == "sse"
            else LineFramer(capture.max_event_bytes)
        )
        self.dialect = detection.dialect
        self._provisional = detection.provisional
        self._decoded = 0
        #: Events per read number, for the reads that carried any.
        self.per_read: dict[int, int] = {}

    def feed(self, number: int, read: Read) -> bool:
        """Take one read; ``False`` once a bound stopped the decoding."""
        try:
            for piece in self._pieces(read.data):
                self._decoded += len(piece)
                # The face stops reading at --max-bytes of raw body; this bounds
                # what a compressed body inflates to.
                if self._inflater is not None and self._decoded > self._capture.max_bytes:
                    self._report.notes.append(
                        f"the body inflated past --max-bytes ({self._capture.max_bytes} bytes): "
                        "the rest was not read"
                    )
                    return False
                try:
                    frames = self._framer.feed(piece)
                except EventTooLarge as exc:
                    self._take(exc.frames, number, read)
                    self._report.notes.append(
                        f"an event grew past {exc.limit} bytes: the rest was not read"
                    )
                    return False
                if not self._take(frames, number, read):
                    return False
        except InflateError as exc:
            self._report.notes.append(
                f"the compressed body is broken ({exc}): the rest was not read"
            )
            return False
        return True

    def _pieces(self, data: bytes) -> Iterator[bytes]:
        """The read's bytes, inflated at most ``_INFLATE_STEP`` at a time (a bomb stays small)."""
        inflater = self._inflater
        if inflater is None:
            yield data
            return
        inflater.feed(data)
        while inflater.pending:
            piece = inflater.take(_INFLATE_STEP)
            if piece:
                yield piece

    def _take(self, frames: list[Frame], number: int, read: Read) -> bool:
        report = self._report
        capture = self._capture
        for frame in frames:
            event = frame.event
            if event is None or event.event == "ping":
                if _is_keepalive(frame):
                    report.keepalives += 1
                    if len(report.keepalive_times) < capture.max_events:
                        report.keepalive_times.append(read.at)
                continue
            if len(report.events) >= capture.max_events:
                report.notes.append(
                    f"more than --max-events ({capture.max_events}) events: the rest was not read"
                )
                return False
            if self._provisional and event.data:
                self.dialect = sniff(event, self.dialect)
                self._provisional = False
            sent = read_stamp(frame.raw)
            observed = self.dialect.inspect(event)
            terminal = observed.terminal
            if observed.error and len(report.error_events) < _KEPT_ERRORS:
                report.error_events.append(event.data[:_ERROR_TEXT])
            report.terminal_seen = report.terminal_seen or terminal
            if report.first_event_at is None:
                report.first_event_at = read.at
            self.per_read[number] = self.per_read.get(number, 0) + 1
            report.events.append(
                EventArrival(
                    index=len(report.events) + 1,
                    at=read.at,
                    read=number,
                    name=event.event,
                    sent_wall=sent,
                    delay=None if sent is None else capture.started_wall + read.at - sent,
                    terminal=terminal,
                )
            )
        return True


def _is_keepalive(frame: Frame) -> bool:
    """A comment-only block (``: keep-alive``, ``: ping``) or an ``event: ping``."""
    if frame.event is not None:
        return True  # event: ping (Anthropic's)
    raw = frame.raw.lstrip(b"\r\n")
    return raw.startswith(b":") and read_stamp(raw) is None


def _silences(capture: Capture, report: Report) -> None:
    """The longest time without a byte, from the request to the end (a held head counts)."""
    moments = [0.0, capture.headers_at, *(read.at for read in capture.reads), capture.ended_at]
    longest, since = 0.0, 0.0
    for before, after in itertools.pairwise(moments):
        if after - before > longest:
            longest, since = after - before, before
    report.longest_silence = longest
    report.longest_silence_from = since


# -- the verdicts --------------------------------------------------------------------


def _verdicts(capture: Capture, report: Report, dialect: Dialect, is_stream: bool) -> list[Verdict]:
    if not 200 <= capture.status < 300 or not is_stream:
        return [_not_a_stream(report)]
    return [
        Verdict(
            Symptom.NOT_A_STREAM, Finding.CLEAR, f"{report.status}, {report.header('Content-Type')}"
        ),
        _buffered(report),
        _compressed(report),
        _keepalives(report),
        _idle_cut(capture, report),
        _truncated(report, dialect),
        _missing_headers(report),
    ]


def _seconds(value: float) -> str:
    if abs(value) < 0.01:
        return f"{value * 1000:.1f} ms"
    return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.1f} s"


def _not_a_stream(report: Report) -> Verdict:
    kind = report.header("Content-Type") or "no Content-Type"
    if not 200 <= report.status < 300:
        evidence = f"the answer was {report.status} ({kind}), not a stream"
        fix = "check the URL, the method, the body (--data) and the credentials (-H)"
    else:
        evidence = f"the answer is {kind}, not an event stream"
        fix = (
            "a hop answered in place of the model (a login page, a WAF), or the request "
            'did not ask for a stream ("stream": true)'
        )
    return Verdict(Symptom.NOT_A_STREAM, Finding.FOUND, evidence, fix)


_BUFFER_FIX = (
    "turn response buffering off for this route on the hop that holds the events: "
    "nginx `proxy_buffering off` (or have the server send `X-Accel-Buffering: no`; "
    "streamwarden does), `proxy_http_version 1.1`; no response buffering in the BFF "
    "(flush after each event); on a CDN, a no-buffering or streaming rule for the path"
)


def _buffered(report: Report) -> Verdict:
    events = report.events
    if len(events) < MIN_EVENTS_FOR_BUFFERING:
        return Verdict(
            Symptom.BUFFERED,
            Finding.UNTESTED,
            f"only {len(events)} events arrived: too few to tell",
        )
    delays = report.delays()
    if len(delays) >= MIN_EVENTS_FOR_BUFFERING:
        least = min(delays)
        held = [d - least for d in delays if d - least >= HELD_SECONDS]
        lumps = _lumps(report)
        if len(held) >= HELD_SHARE * len(delays):
            evidence = (
                f"{len(held)} of {len(delays)} events waited in the path {HELD_SECONDS:g} s or "
                f"more beyond the quickest one (up to {_seconds(max(held))}); "
                f"path delay {_seconds(least)} to {_seconds(max(delays))}; "
                f"{_lump_text(report, lumps)}"
            )
            return Verdict(Symptom.BUFFERED, Finding.FOUND, evidence, _BUFFER_FIX)
        return Verdict(
            Symptom.BUFFERED,
            Finding.CLEAR,
            f"each event left the path within {_seconds(max(delays) - least)} of the quickest "
            f"(path delay {_seconds(least)} to {_seconds(max(delays))})",
        )
    lumps = _lumps(report)
    in_lumps = sum(count for _, count in lumps)
    spread = events[-1].at - events[0].at
    if (
        in_lumps >= HELD_SHARE * len(events)
        and len(lumps) == 1
        and events[0].at >= ALL_AT_ONCE_WAIT_SECONDS
        and spread < ALL_AT_ONCE_SECONDS
    ):
        evidence = (
            f"all {len(events)} events arrived within {_seconds(spread)}, "
            f"{_seconds(events[0].at)} after the request: held until the end (no send times)"
        )
        return Verdict(Symptom.BUFFERED, Finding.FOUND, evidence, _BUFFER_FIX)
    if in_lumps >= HELD_SHARE * len(events) and _gaps_between(report, lumps) >= LUMP_GAP_SECONDS:
        evidence = f"{_lump_text(report, lumps)}, with silences between them (no send times)"
        return Verdict(Symptom.BUFFERED, Finding.FOUND, evidence, _BUFFER_FIX)
    return Verdict(
        Symptom.BUFFERED,
        Finding.CLEAR,
        f"{len(events)} events in {len(set(e.read for e in events))} reads "
        f"(at most {max(report.events_per_read)} per read), over {_seconds(spread)}",
    )


def _lumps(report: Report) -> list[tuple[int, int]]:
    """(read number, events) for the reads that carried a lump."""
    count: dict[int, int] = {}
    for event in report.events:
        count[event.read] = count.get(event.read, 0) + 1
    return [(read, n) for read, n in sorted(count.items()) if n >= LUMP_EVENTS]


def _lump_text(report: Report, lumps: list[tuple[int, int]]) -> str:
    if not lumps:
        return "the events came one or two to a read"
    biggest = max(n for _, n in lumps)
    return (
        f"{sum(n for _, n in lumps)} of {len(report.events)} events came in {len(lumps)} "
        f"lump{'s' if len(lumps) > 1 else ''} (up to {biggest} events in one network read)"
    )


def _gaps_between(report: Report, lumps: list[tuple[int, int]]) -> float:
    """The median silence before each lump's read (0 when there is one lump)."""
    at = {event.read: event.at for event in report.events}
    reads = sorted(at)
    gaps = []
    for read, _ in lumps:
        position = reads.index(read)
        if position > 0:
            gaps.append(at[read] - at[reads[position - 1]])
    return statistics.median(gaps) if gaps else 0.0


def _compressed(report: Report) -> Verdict:
    coding = report.header("Content-Encoding")
    if coding is None or coding.strip().lower() in ("", "identity"):
        return Verdict(Symptom.COMPRESSED, Finding.CLEAR, "no Content-Encoding")
    if report.stamped:
        who = (
            "the far end (streamwarden mock-upstream) never compresses, so a hop on the path "
            "added it"
        )
    else:
        who = "the server or a hop on the path added it"
    server = report.header("Server") or report.header("Via")
    if server:
        who += f" (the last hop says Server/Via: {server})"
    evidence = f"Content-Encoding: {coding} on an event stream: {who}"
    fix = (
        "never compress text/event-stream: nginx, remove it from `gzip_types`; Express "
        "`compression`, a filter that skips it; a CDN, exclude the route; a compressor "
        "holds bytes until its block fills, so events arrive in lumps"
    )
    return Verdict(Symptom.COMPRESSED, Finding.FOUND, evidence, fix)


_KEEPALIVE_FIX = (
    "send a comment `: keep-alive` when the stream has been quiet for a while "
    "(streamwarden's `keepalive_interval`, 15 s by default), well under the shortest idle "
    "timeout on the path (nginx `proxy_read_timeout` 60 s, AWS ALB 60 s, Cloudflare 100 s)"
)


def _keepalives(report: Report) -> Verdict:
    silence = report.longest_silence
    if report.keepalives:
        return Verdict(
            Symptom.NO_KEEPALIVES,
            Finding.CLEAR,
            f"{report.keepalives} keep-alive{'s' if report.keepalives > 1 else ''} seen; "
            f"longest silence {_seconds(silence)}",
        )
    asked = report.stall
    if asked is not None and silence >= STALL_SEEN_SHARE * asked:
        return Verdict(
            Symptom.NO_KEEPALIVES,
            Finding.FOUND,
            f"no keep-alive during a {_seconds(silence)} silence (--stall {asked:g}s asked)",
            _KEEPALIVE_FIX,
        )
    if silence >= KEEPALIVE_EXPECTED_SECONDS:
        return Verdict(
            Symptom.NO_KEEPALIVES,
            Finding.FOUND,
            f"no keep-alive during a {_seconds(silence)} silence",
            _KEEPALIVE_FIX,
        )
    return Verdict(
        Symptom.NO_KEEPALIVES,
        Finding.UNTESTED,
        f"none seen, but the stream was never quiet long enough to need one (longest "
        f"silence {_seconds(silence)}); probe with --stall 30s to find out",
    )


def _longest_gap_between_events(report: Report) -> float:
    """The far end's longest pause: between send times when stamped, else between arrivals."""
    times = [e.sent_wall for e in report.events if e.sent_wall is not None]
    if len(times) < len(report.events) or not times:
        times = [e.at for e in report.events]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return max(gaps, default=0.0)


def _idle_cut(capture: Capture, report: Report) -> Verdict:
    last_byte = capture.reads[-1].at if capture.reads else capture.headers_at
    silence = capture.ended_at - last_byte
    asked = f" (--stall {capture.stall:g}s asked)" if capture.stall is not None else ""
    if not report.decoded_whole and not report.terminal_seen:
        return Verdict(
            Symptom.IDLE_CUT, Finding.UNTESTED, "the probe could not read the stream to its end"
        )
    if report.ending is Ending.GAVE_UP:
        return Verdict(
            Symptom.IDLE_CUT,
            Finding.CLEAR if silence >= IDLE_CUT_MIN_SECONDS else Finding.UNTESTED,
            f"the path kept the connection open for {_seconds(silence)} of silence until the "
            "probe stopped reading (--max-time)",
        )
    if report.terminal_seen or report.ending is Ending.TOO_LARGE:
        if capture.stall is not None:
            quiet = _longest_gap_between_events(report)
            if quiet < STALL_SEEN_SHARE * capture.stall:
                return Verdict(
                    Symptom.IDLE_CUT,
                    Finding.UNTESTED,
                    f"the far end never paused for the asked --stall (longest gap between "
                    f"events {_seconds(quiet)}): is it streamwarden mock-upstream, or a sidecar "
                    "in front of one?",
                )
            held = f", held open by {_count(report.keepalives, 'keep-alive')}"
            return Verdict(
                Symptom.IDLE_CUT,
                Finding.CLEAR,
                f"the stream survived a {_seconds(quiet)} pause between events{asked}"
                f"{held if report.keepalives else ''}",
            )
        return Verdict(
            Symptom.IDLE_CUT,
            Finding.UNTESTED,
            f"the stream ended whole; its longest silence was {_seconds(report.longest_silence)}"
            "; probe with --stall 75s to find the path's idle timeout",
        )
    gaps = [b.at - a.at for a, b in itertools.pairwise(capture.reads)]
    usual = statistics.median(gaps) if gaps else 0.0
    if silence >= IDLE_CUT_MIN_SECONDS and silence >= IDLE_CUT_GAP_FACTOR * usual:
        how = "closed" if report.ending is Ending.COMPLETE else "cut"
        evidence = (
            f"the connection was {how} after {silence:.1f} s of silence{asked}, without "
            f"{report.terminal_event}: an idle timeout"
        )
        fix = (
            f"keep `keepalive_interval` well under {silence:.0f} s (streamwarden's keep-alives "
            "reset every idle timer on the path), or raise the timeout of the hop that cut it "
            "(nginx `proxy_read_timeout`, ALB idle timeout)"
        )
        return Verdict(Symptom.IDLE_CUT, Finding.FOUND, evidence, fix)
    return Verdict(
        Symptom.IDLE_CUT,
        Finding.CLEAR,
        f"the stream ended {_seconds(silence)} after its last byte: not after a silence",
    )


def _truncated(report: Report, dialect: Dialect) -> Verdict:
    if report.terminal_seen:
        return Verdict(
            Symptom.TRUNCATED,
            Finding.CLEAR,
            f"ended with its terminal event ({report.terminal_event})",
        )
    if report.ending in (Ending.GAVE_UP, Ending.TOO_LARGE) or not report.decoded_whole:
        return Verdict(
            Symptom.TRUNCATED,
            Finding.UNTESTED,
            "the probe stopped reading before the stream ended",
        )
    if not dialect.expects_terminal:
        return Verdict(
            Symptom.TRUNCATED,
            Finding.UNTESTED,
            f"the {report.dialect} format has no terminal event to look for",
        )
    how = (
        "ended cleanly" if report.ending is Ending.COMPLETE else f"broke ({report.error or 'cut'})"
    )
    evidence = f"the stream {how} after {len(report.events)} events without {report.terminal_event}"
    if report.error_events:
        evidence += f"; it carried an error event: {report.error_events[0]}"
    elif report.ending is Ending.COMPLETE:
        evidence += ": the official SDKs end silently on this, with half an answer"
    fix = (
        "find the hop that ends the response early (its timeouts, its body size limits); "
        "streamwarden in front turns such an end into an error event the SDKs raise "
        "(code stream_truncated)"
    )
    return Verdict(Symptom.TRUNCATED, Finding.FOUND, evidence, fix)


def _missing_headers(report: Report) -> Verdict:
    cache = (report.header("Cache-Control") or "").lower()
    directives = {d.strip().split("=", 1)[0] for d in cache.split(",") if d.strip()}
    accel = (report.header("X-Accel-Buffering") or "").strip().lower()
    # nginx acts on X-Accel-Buffering and removes it: behind nginx its absence says nothing.
    behind_nginx = "nginx" in (report.header("Server") or "").lower()
    missing = [
        name
        for name, present in (
            ("Cache-Control: no-cache", "no-cache" in directives or "no-store" in directives),
            ("Cache-Control: no-transform", "no-transform" in directives),
            ("X-Accel-Buffering: no", accel == "no" or behind_nginx),
        )
        if not present
    ]
    if not missing:
        return Verdict(Symptom.MISSING_HEADERS, Finding.CLEAR, "all present")
    evidence = f"the response arrived without {', '.join(missing)}"
    fix = (
        "have the server (or streamwarden, which adds all three) send them, so that hops "
        "that buffer or transform by default leave the stream alone"
    )
    return Verdict(Symptom.MISSING_HEADERS, Finding.FOUND, evidence, fix)


# -- output --------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "–" if value is None else _seconds(value)


def render_text(report: Report, request_line: str, sent_headers: Sequence[tuple[str, str]]) -> str:
    """The terminal report. ``sent_headers`` must already be redacted."""
    lines = [f"streamwarden probe: {request_line}"]
    lines.extend(f"  > {name}: {value}" for name, value in sent_headers)
    lines.append(f"status {report.status}, headers after {_ms(report.headers_at)}")
    shown = report.streaming_headers()
    lines.extend(f"  < {name}: {value}" for name, value in shown)
    lines.append(f"dialect {report.dialect}; ending: {_ending_text(report)}")
    per_read = ", ".join(
        f"{_count(reads, 'read')} of {events}" for events, reads in report.events_per_read.items()
    )
    lines.append(
        f"first byte {_ms(report.first_byte_at)}, first event {_ms(report.first_event_at)}; "
        f"{_count(len(report.events), 'event')} in {_count(report.reads, 'read')}"
        f"{f' ({per_read})' if per_read else ''}; longest silence "
        f"{_ms(report.longest_silence)} from {_ms(report.longest_silence_from)}; "
        f"keep-alives {report.keepalives}"
    )
    delays = report.delays()
    if delays:
        lines.append(
            f"path delay (send to arrival) min {_ms(min(delays))}, median "
            f"{_ms(statistics.median(delays))}, max {_ms(max(delays))} "
            f"({len(delays)} stamped events)"
        )
    else:
        why = (
            "a line-based stream has no comment lines to carry send times"
            if report.framing == "lines"
            else "the far end does not stamp its events"
        )
        lines.append(f"path delay: unknown ({why})")
    lines.extend(f"note: {note}" for note in report.notes)
    lines.extend(f"error event: {data}" for data in report.error_events)
    lines.extend(_event_lines(report))
    lines.extend(_verdict_lines(report))
    return "\n".join(lines) + "\n"


def _event_lines(report: Report) -> list[str]:
    """The report's table of events: the first and last few, when there are many."""
    if not report.events:
        return []
    lines = ["events:   #   arrival   read  path delay  event"]
    events = report.events
    listed = (
        events
        if len(events) <= _LISTED_HEAD + _LISTED_TAIL
        else [*events[:_LISTED_HEAD], None, *events[-_LISTED_TAIL:]]
    )
    for event in listed:
        if event is None:
            lines.append(f"        ... {len(events) - _LISTED_HEAD - _LISTED_TAIL} more")
            continue
        mark = " (terminal)" if event.terminal else ""
        lines.append(
            f"      {event.index:4d} {event.at:8.3f} s {event.read:5d}  "
            f"{_ms(event.delay):>10}  {event.name}{mark}"
        )
    return lines


def _verdict_lines(report: Report) -> list[str]:
    """A line per symptom (with its fix when found), then the result."""
    lines = ["verdicts:"]
    for verdict in report.verdicts:
        label = verdict.finding.value.upper() if verdict.fails else verdict.finding.value
        if verdict.finding is Finding.FOUND and not verdict.fails:
            label = "warning"
        lines.append(f"  {verdict.symptom.value:<30} {label:<9} {verdict.evidence}")
        if verdict.finding is Finding.FOUND and verdict.fix:
            lines.append(f"  {'':<30} {'fix:':<9} {verdict.fix}")
    found = [v.symptom.value for v in report.verdicts if v.fails]
    lines.append(f"result: {', '.join(found) if found else 'clean'}")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _ending_text(report: Report) -> str:
    terminal = (
        f"with {report.terminal_event}"
        if report.terminal_seen
        else f"without {report.terminal_event}"
    )
    texts = {
        Ending.COMPLETE: f"cleanly, {terminal}",
        Ending.BROKEN: f"broken ({report.error or 'connection lost'}), {terminal}",
        Ending.GAVE_UP: f"still open when the probe stopped reading, {terminal}",
        Ending.TOO_LARGE: f"past --max-bytes, the probe stopped reading, {terminal}",
    }
    return f"{texts[report.ending]} at {_ms(report.ended_at)}"


def report_json(
    report: Report, request_line: str, sent_headers: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """The report for ``--json``. ``sent_headers`` must already be redacted."""
    return {
        "request": {"line": request_line, "headers": [list(pair) for pair in sent_headers]},
        "status": report.status,
        "headers": [list(pair) for pair in report.streaming_headers()],
        "dialect": report.dialect,
        "ending": report.ending.value,
        "error": report.error,
        "terminal_event": report.terminal_event,
        "terminal_seen": report.terminal_seen,
        "headers_s": report.headers_at,
        "first_byte_s": report.first_byte_at,
        "first_event_s": report.first_event_at,
        "ended_s": report.ended_at,
        "reads": report.reads,
        "body_bytes": report.body_bytes,
        "events_per_read": {str(k): v for k, v in report.events_per_read.items()},
        "longest_silence_s": report.longest_silence,
        "longest_silence_from_s": report.longest_silence_from,
        "keepalives": report.keepalives,
        "keepalive_s": report.keepalive_times,
        "stall_s": report.stall,
        "events": [
            {
                "index": e.index,
                "arrival_s": e.at,
                "read": e.read,
                "event": e.name,
                "sent_unix": e.sent_wall,
                "path_delay_s": e.delay,
                "terminal": e.terminal,
            }
            for e in report.events
        ],
        "error_events": report.error_events,
        "notes": report.notes,
        "verdicts": [
            {
                "symptom": v.symptom.value,
                "finding": v.finding.value,
                "fails": v.fails,
                "evidence": v.evidence,
                "fix": v.fix,
            }
            for v in report.verdicts
        ],
        "symptoms": [v.symptom.value for v in report.verdicts if v.fails],
    }
