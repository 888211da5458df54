"""The load client: opens streams, and times every event from upstream send to receive.

Runs in its own process (``python -m bench.client SPEC_JSON``) and prints
one JSON summary line on stdout. Four modes:

- ``stream``: ``streams`` concurrent SSE streams at ``tps`` events/s each,
  opened evenly over ``ramp_s`` (so their phases spread out, unless
  ``align`` asks the upstream to put every stream's events in one shared
  decode step), then a measured window of ``measure_s``. For each event received in the window
  it keeps ``receive - send`` (ns, one monotonic clock); per stream, the
  time from connect to first event (TTFT). At the window's edges it reads
  the CPU time of the processes named in ``cpu_pids`` (the proxy, the
  upstream) and its own, so a saturated client or upstream shows up in the
  results instead of passing for a slow proxy. Latencies go to the binary
  file ``samples`` (native int64); they would swamp a JSON line.
- ``idle``: opens ``streams`` streams that get headers and then silence,
  prints ``{"opened": ...}``, waits for a line on stdin, closes them all.
- ``cancel``: one request at a time per target, upstream silent; closes the
  socket (FIN) and records when; then asks the upstream when it saw each
  close. Targets alternate sample by sample, so drift hits all alike.
- ``ttft``: one request at a time per target, alternating: a streamed
  request (connect to first event) and a non-streamed one (connect to the
  whole body).

The stream mode is a bare ``asyncio.Protocol`` on uvloop: per event it takes
one clock reading per read, a ``find`` and an ``int()``. The cancel and
TTFT modes use blocking sockets, one request at a time, which is both the
leanest and the most precise way to time a single exchange.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from array import array
from typing import Any, cast

from bench import procfs
from bench.wire import STAMP_DIGITS, STAMP_MARK, ChunkedDecoder, Head, get, request

_MARK_LEN = len(STAMP_MARK)
_LAG_TICK = 0.01


class StreamRun:
    """Shared state of one ``stream`` run."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.host: str = spec["host"]
        self.port: int = spec["port"]
        start = int(spec["start_ns"])
        self.window_start = start + int((spec["ramp_s"] + spec["settle_s"]) * 1e9)
        self.window_end = self.window_start + int(spec["measure_s"] * 1e9)
        self.latencies: array[int] = array("q")
        self.ttfts: list[int] = []
        self.window_events = 0
        self.total_events = 0
        self.opened = 0
        self.failed = 0
        self.broken = 0
        self.completed = 0
        self.closing = False
        self.streams: list[StreamProtocol] = []
        self.lag_max = 0.0
        self.lags: list[float] = []


class StreamProtocol(asyncio.Protocol):
    """One SSE stream; records a latency per stamped event."""

    __slots__ = (
        "body",
        "dechunk",
        "done",
        "first",
        "head",
        "head_done",
        "run",
        "t_open",
        "transport",
    )

    def __init__(self, run: StreamRun, target: str) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.head = bytearray(request(run.host, run.port, target))
        self.head_done = False
        self.dechunk: ChunkedDecoder | None = ChunkedDecoder()
        self.body = bytearray()
        self.first = True
        self.done = False
        self.t_open = time.monotonic_ns()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.write(bytes(self.head))
        self.head.clear()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        run = self.run
        if not self.head_done:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head = Head(bytes(self.head[:end]))
            data = bytes(self.head[end + 4 :])
            self.head_done = True
            if head.status != 200:
                run.failed += 1
                self._finish()
                return
            run.opened += 1
            if not head.chunked:
                self.dechunk = None
            if not data:
                return
        dechunk = self.dechunk
        body = self.body
        body += dechunk.feed(data) if dechunk is not None else data
        end = body.rfind(b"\n\n")
        if end >= 0:
            pos = 0
            find = body.find
            in_window = run.window_start <= now < run.window_end
            count = 0
            while (i := find(STAMP_MARK, pos, end)) >= 0:
                j = i + _MARK_LEN
                pos = j + STAMP_DIGITS
                count += 1
                if in_window:
                    run.latencies.append(now - int(body[j:pos]))
            if count:
                run.total_events += count
                if in_window:
                    run.window_events += count
                if self.first:
                    self.first = False
                    run.ttfts.append(now - self.t_open)
            del body[: end + 2]
        if dechunk is not None and dechunk.done:
            run.completed += 1
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done and not self.run.closing:
            self.run.broken += 1
        self.done = True

    def _finish(self) -> None:
        self.done = True
        if self.transport is not None:
            self.transport.close()


async def _lag_probe(run: StreamRun) -> None:
    """How late the client's loop wakes up: a loaded client inflates every latency."""
    # time.monotonic, not loop.time: uvloop's clock only moves in whole milliseconds.
    while not run.closing:
        before = time.monotonic()
        await asyncio.sleep(_LAG_TICK)
        lag = time.monotonic() - before - _LAG_TICK
        run.lags.append(lag)
        run.lag_max = max(run.lag_max, lag)


async def stream_mode(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    run = StreamRun(spec)
    streams: int = spec["streams"]
    index, of = spec.get("index", 0), spec.get("of", 1)
    total = streams * of
    ramp = spec["ramp_s"]
    target = f"{spec['path']}?tps={spec['tps']:g}&n={spec['events']}"
    if spec.get("align"):
        target += "&align=1"  # every stream's events in the upstream's shared decode step
    start = int(spec["start_ns"])
    cpu_pids: dict[str, list[int]] = spec.get("cpu_pids", {})

    async def open_one(protocol: StreamProtocol) -> None:
        protocol.t_open = time.monotonic_ns()
        try:
            await loop.create_connection(lambda: protocol, run.host, run.port)
        except OSError:
            run.failed += 1
            protocol.done = True

    tasks: list[asyncio.Task[None]] = []

    def launch(protocol: StreamProtocol) -> None:
        tasks.append(loop.create_task(open_one(protocol)))

    for k in range(streams):
        slot = index + k * of  # interleave the processes' streams over the ramp
        at = start + int(slot * ramp * 1e9 / max(total, 1))
        protocol = StreamProtocol(run, target)
        run.streams.append(protocol)
        loop.call_later(max(0.0, (at - time.monotonic_ns()) / 1e9), launch, protocol)

    cpu: dict[str, list[float]] = {}

    def sample_cpu() -> None:
        for name, pids in cpu_pids.items():
            cpu.setdefault(name, []).append(procfs.cpu_seconds(pids))
        cpu.setdefault("client", []).append(time.process_time())
        if spec.get("machine"):
            cpu.setdefault("machine", []).append(procfs.machine_busy_seconds())

    probe = loop.create_task(_lag_probe(run))
    loop.call_later(max(0.0, (run.window_start - time.monotonic_ns()) / 1e9), sample_cpu)
    await asyncio.sleep(max(0.0, (run.window_end - time.monotonic_ns()) / 1e9))
    sample_cpu()
    run.closing = True
    for protocol in run.streams:
        if protocol.transport is not None and not protocol.done:
            protocol.transport.close()
    for task in tasks:
        task.cancel()
    probe.cancel()
    await asyncio.sleep(0.05)
    with open(spec["samples"], "wb") as out:
        run.latencies.tofile(out)
    lags = sorted(run.lags)
    window = (run.window_end - run.window_start) / 1e9
    return {
        "opened": run.opened,
        "failed": run.failed,
        "broken": run.broken,
        "completed": run.completed,
        "window_s": window,
        "window_events": run.window_events,
        "total_events": run.total_events,
        "samples": len(run.latencies),
        "ttft_ns": run.ttfts,
        "cpu_s": {name: v[-1] - v[0] if len(v) == 2 else None for name, v in cpu.items()},
        "loop_lag_ms": {
            "p99": round(lags[int(len(lags) * 0.99)] * 1e3, 3) if lags else None,
            "max": round(run.lag_max * 1e3, 3),
        },
    }


class IdleProtocol(asyncio.Protocol):
    """A stream whose upstream stays silent after the headers."""

    __slots__ = ("buf", "opened", "request", "transport")

    def __init__(self, request_bytes: bytes) -> None:
        self.request = request_bytes
        self.buf = bytearray()
        self.opened: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport = cast(asyncio.Transport, transport)
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.opened.done():
            return
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end >= 0:
            self.opened.set_result(Head(bytes(self.buf[:end])).status == 200)
            self.buf.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_result(False)


async def idle_mode(spec: dict[str, Any]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    host, port, count = spec["host"], spec["port"], spec["streams"]
    limit = asyncio.Semaphore(spec.get("parallel", 200))
    protocols: list[IdleProtocol] = []
    errors: dict[str, int] = {}
    deadline = time.monotonic() + spec.get("open_timeout_s", 120.0)

    async def open_one(i: int) -> bool:
        async with limit:
            if time.monotonic() > deadline:
                return False
            protocol = IdleProtocol(request(host, port, f"{spec['path']}?idle=1&cid=idle-{i}"))
            protocols.append(protocol)
            try:
                await loop.create_connection(lambda: protocol, host, port)
                async with asyncio.timeout(30):
                    if await protocol.opened:
                        return True
                    errors["refused or closed"] = errors.get("refused or closed", 0) + 1
            except (OSError, TimeoutError) as exc:
                kind = type(exc).__name__ + (
                    f" errno {exc.errno}" if isinstance(exc, OSError) else ""
                )
                errors[kind] = errors.get(kind, 0) + 1
            return False

    started = time.monotonic()
    results = await asyncio.gather(*(open_one(i) for i in range(count)))
    opened = sum(results)
    print(
        json.dumps(
            {"opened": opened, "open_s": round(time.monotonic() - started, 2), "errors": errors}
        ),
        flush=True,
    )
    await loop.run_in_executor(None, sys.stdin.readline)
    for protocol in protocols:
        if protocol.transport is not None:
            protocol.transport.close()
    await asyncio.sleep(0.2)
    return {"opened": opened, "requested": count}


def _read_head(sock: socket.socket, buf: bytearray) -> Head:
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("closed before the response head")
        buf += data
    head = Head(bytes(buf[:end]))
    del buf[: end + 4]
    return head


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def cancel_mode(spec: dict[str, Any]) -> dict[str, Any]:
    host = spec["host"]
    targets: dict[str, int] = spec["targets"]
    closed_at: dict[str, tuple[str, int]] = {}
    errors: dict[str, int] = dict.fromkeys(targets, 0)
    for i in range(spec["samples"]):
        for name, port in targets.items():
            cid = f"{spec['tag']}-{name}-{i}"
            try:
                sock = _connect(host, port)
                sock.sendall(request(host, port, f"{spec['path']}?idle=1&cid={cid}"))
                head = _read_head(sock, bytearray())
            except OSError:
                errors[name] += 1
                continue
            if head.status != 200:
                errors[name] += 1
            # Let the proxy settle into waiting on its silent upstream.
            time.sleep(spec.get("settle_s", 0.02))
            closed_at[cid] = (name, time.monotonic_ns())
            sock.close()
            time.sleep(spec.get("gap_s", 0.01))
    time.sleep(spec.get("wait_s", 1.0))  # a slow path still gets this long to close
    seen = _get_json(host, spec["upstream_port"], "/_bench/closes")
    delays: dict[str, list[int]] = {name: [] for name in targets}
    missing: dict[str, int] = dict.fromkeys(targets, 0)
    for cid, (name, at) in closed_at.items():
        if cid in seen:
            delays[name].append(int(seen[cid]) - at)
        else:
            missing[name] += 1
    return {"delays_ns": delays, "missing": missing, "errors": errors}


def _get_json(host: str, port: int, target: str) -> Any:
    with _connect(host, port) as sock:
        sock.sendall(get(host, port, target))
        buf = bytearray()
        head = _read_head(sock, buf)
        length = head.content_length or 0
        while len(buf) < length:
            data = sock.recv(65536)
            if not data:
                break
            buf += data
    return json.loads(bytes(buf[:length]))


def _ttft_streamed(host: str, port: int, path: str) -> int:
    started = time.monotonic_ns()
    with _connect(host, port) as sock:
        sock.sendall(request(host, port, f"{path}?tps=1000&n=1"))
        buf = bytearray()
        head = _read_head(sock, buf)
        if head.status != 200:
            raise ConnectionError(f"status {head.status}")
        dechunk = ChunkedDecoder()
        body = bytearray(dechunk.feed(bytes(buf)))
        first = 0
        while not dechunk.done:
            if not first and STAMP_MARK in body:
                first = time.monotonic_ns()
            data = sock.recv(65536)
            if not data:
                break
            body += dechunk.feed(data)
        if not first and STAMP_MARK in body:
            first = time.monotonic_ns()
    if not first:
        raise ConnectionError("no event")
    return first - started


def _ttft_whole(host: str, port: int, path: str) -> int:
    started = time.monotonic_ns()
    with _connect(host, port) as sock:
        sock.sendall(request(host, port, f"{path}?mode=json&n=20"))
        buf = bytearray()
        head = _read_head(sock, buf)
        length = head.content_length
        if head.status != 200 or length is None:
            raise ConnectionError(f"status {head.status}")
        while len(buf) < length:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("short body")
            buf += data
        done = time.monotonic_ns()
    return done - started


def ttft_mode(spec: dict[str, Any]) -> dict[str, Any]:
    host, path = spec["host"], spec["path"]
    targets: dict[str, int] = spec["targets"]
    streamed: dict[str, list[int]] = {name: [] for name in targets}
    whole: dict[str, list[int]] = {name: [] for name in targets}
    errors: dict[str, int] = dict.fromkeys(targets, 0)
    for _ in range(spec["samples"]):
        for name, port in targets.items():
            try:
                streamed[name].append(_ttft_streamed(host, port, path))
                whole[name].append(_ttft_whole(host, port, path))
            except OSError:
                errors[name] += 1
            time.sleep(spec.get("gap_s", 0.002))
    return {"streamed_ns": streamed, "whole_ns": whole, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec: dict[str, Any] = json.loads(args[0])
    procfs.raise_fd_limit()
    mode = spec["mode"]
    result: dict[str, Any]
    if mode == "stream":
        result = procfs.run(stream_mode(spec), uvloop=spec.get("uvloop", True))
    elif mode == "idle":
        result = procfs.run(idle_mode(spec), uvloop=spec.get("uvloop", True))
    elif mode == "cancel":
        result = cancel_mode(spec)
    elif mode == "ttft":
        result = ttft_mode(spec)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
