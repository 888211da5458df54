"""The processes of a benchmark run: the upstream, and each path under test.

A path is a way from the load client to the upstream:

- ``direct``: no proxy; the baseline every other path is compared with;
- ``sidecar``: ``streamwarden run --event-loop asyncio``;
- ``sidecar-uvloop``: ``streamwarden run --uvloop`` (what ``run`` picks by
  itself when uvloop is installed);
- ``nginx``: Debian's nginx, one worker, ``proxy_buffering off``, HTTP/1.1
  with a keep-alive pool to the upstream (``keepalive 256``,
  ``proxy_http_version 1.1``, ``Connection ""``: the usual SSE setup);
- ``fastapi-mw``: a FastAPI gateway with ``StreamWardenMiddleware`` under
  uvicorn (:mod:`bench.gateway`);
- ``fastapi``: the same gateway without the middleware, so the middleware's
  own share can be told from the gateway's;
- ``sidecar-resume`` and ``sidecar-resume-redis`` (not in a default run;
  ask for them by name): ``sidecar-uvloop`` on a resumable route
  (``on_client_gone: detach``: every event gets an id and goes to the
  resume store), with the memory store or a Redis (Debian's
  ``redis-server``, started for the path; its own CPU is not the
  sidecar's and is not counted);
- ``sidecar-otel`` (ask for it by name): ``sidecar-uvloop`` with
  OpenTelemetry on (``otel_exporter: otlp-http``), exporting to a local
  sink (:mod:`bench.otlp_sink`, its own process);
- ``sidecar-source`` (ask for it by name): ``sidecar-uvloop`` with its
  per-event modules run from source (``STREAMWARDEN_PURE_PYTHON=1``), what
  an install without a C compiler runs: the compiled build's gain, in the
  same windows;
- ``sidecar-base`` (ask for it by name): ``sidecar-uvloop`` run by the
  interpreter in ``$BENCH_BASE_PYTHON``, another build's venv: a before
  and after of two commits in the same windows;
- ``floor`` and ``floor-httptools`` (not in a default run; ask for them by
  name): the thinnest streaming proxy Python on uvloop can be
  (:mod:`bench.floor`), raw bytes, or with httptools parsing the response:
  the lower bound of any Python/uvloop proxy on this machine.

Every process listens on a loopback port chosen at start, runs with a
raised descriptor limit, and is one OS process whose CPU time and resident
memory the harness reads from /proc (nginx: its worker).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import procfs
from bench.wire import Head, get

__all__ = [
    "ALL_PATHS",
    "EXTRA_PATHS",
    "KNOWN_PATHS",
    "PROXIES",
    "Running",
    "free_port",
    "start_path",
    "start_upstream",
]

ALL_PATHS = ("direct", "sidecar", "sidecar-uvloop", "nginx", "fastapi-mw", "fastapi")
PROXIES = ALL_PATHS[1:]
#: Paths a run loads only when asked for by name (``--paths``, ``Bench(...)``).
EXTRA_PATHS = (
    "floor",
    "floor-httptools",
    "sidecar-resume",
    "sidecar-resume-redis",
    "sidecar-otel",
    "sidecar-source",
    "sidecar-base",
)
KNOWN_PATHS = ALL_PATHS + EXTRA_PATHS
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent

_DESCRIPTIONS = {
    "direct": "load client straight to the upstream (baseline)",
    "sidecar": "streamwarden run --event-loop asyncio",
    "sidecar-uvloop": "streamwarden run --uvloop",
    "nginx": "nginx, 1 worker, proxy_buffering off, HTTP/1.1 keep-alive upstream",
    "fastapi-mw": "FastAPI gateway + StreamWardenMiddleware under uvicorn",
    "fastapi": "the same FastAPI gateway without the middleware",
    "sidecar-resume": "streamwarden run --uvloop, on_client_gone: detach, memory store",
    "sidecar-resume-redis": "streamwarden run --uvloop, on_client_gone: detach, Redis store",
    "sidecar-otel": "streamwarden run --uvloop, otel_exporter: otlp-http (a local sink)",
    "sidecar-source": "streamwarden run --uvloop, per-event modules from source (not compiled)",
    "sidecar-base": "streamwarden run --uvloop of another build ($BENCH_BASE_PYTHON's install)",
    "floor": "bench.floor: bytes forwarded as read, uvloop, no parsing (Python's floor)",
    "floor-httptools": "bench.floor --httptools: the floor plus httptools on the response",
}

_NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
worker_rlimit_nofile {fds};
events {{
    worker_connections {connections};
}}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    # A keep-alive pool to the upstream, as a production config has it;
    # 256 idle connections at most, the sidecar's upstream_pool_size default.
    upstream llm {{
        server {host}:{upstream};
        keepalive 256;
    }}
    server {{
        listen {host}:{port} backlog=4096;
        location / {{
            proxy_pass http://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _base_python() -> str:
    """The interpreter of the build ``sidecar-base`` runs: a before/after in the same windows."""
    python = os.environ.get("BENCH_BASE_PYTHON")
    if not python:
        raise RuntimeError("sidecar-base needs BENCH_BASE_PYTHON: another build's venv python")
    return python


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # The children must not inherit a profiler or coverage hook of the parent.
    env.pop("COV_CORE_SOURCE", None)
    return env


def _raise_limits() -> None:
    procfs.raise_fd_limit()


@dataclass
class Running:
    """A started path (or the upstream): its port and the processes to measure."""

    name: str
    port: int
    description: str
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    #: The processes whose CPU and memory count as the path's.
    measured: list[int] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    #: A process the path needs but whose cost is not the path's (its Redis).
    companion: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def stop(self) -> None:
        self._stop()
        companion, self.companion = self.companion, None
        if companion is not None and companion.poll() is None:
            companion.kill()
            companion.wait(2.0)

    def _stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        # The sidecar drains on the first SIGTERM (up to drain_timeout with
        # streams open) and exits at once on the second.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(1.0)
            return
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(2.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(2.0)


def wait_http(port: int, target: str, timeout: float) -> None:
    """Wait until ``GET target`` on the port answers 200."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=2) as sock:
                sock.sendall(get(HOST, port, target))
                buf = bytearray()
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(4096)
                    if not data:
                        break
                    buf += data
                head = Head(bytes(buf.split(b"\r\n\r\n", 1)[0]))
                if head.status == 200:
                    return
                last = RuntimeError(f"status {head.status}")
        except OSError as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not answer {target} in {timeout}s: {last}")


def _popen(args: list[str], log: Path, **kwargs: object) -> subprocess.Popen[bytes]:
    kwargs.setdefault("env", _child_env())
    with open(log, "wb") as out:
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            preexec_fn=_raise_limits,
            **kwargs,
        )


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A redis-server for a resumable path, nothing persisted; waits until it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = _popen(
        [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"],
        workdir / "redis.log",
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2) as probe:
            probe.sendall(b"PING\r\n")
            if probe.recv(16).startswith(b"+PONG"):
                return process, port
        time.sleep(0.02)
    process.kill()
    raise RuntimeError("redis-server did not answer PING within 10 s")


def start_upstream(workdir: Path) -> Running:
    log = workdir / "upstream.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.upstream", "--listen", f"{HOST}:0"],
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 - the child owns it from here
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=_child_env(),
        preexec_fn=_raise_limits,
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    if not line.startswith("READY "):
        process.kill()
        raise RuntimeError(f"the upstream did not start: {line!r}, see {log}")
    port = int(line.split()[1])
    return Running(
        "upstream",
        port,
        "bench.upstream (uvloop, one asyncio.Protocol per connection)",
        process,
        log,
        [process.pid],
    )


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def start_path(name: str, upstream: Running, workdir: Path) -> Running:
    """Start one path in front of the upstream and wait until it proxies."""
    return await_path(launch_path(name, upstream, workdir))


def launch_path(name: str, upstream: Running, workdir: Path) -> Running:
    """Start one path's process without waiting for it (paths start side by side)."""
    base, *patches = name.split("+")
    burn = name[len("floor-burn") :] if name.startswith("floor-burn") else ""
    if burn:
        base = "floor"
    description = _DESCRIPTIONS[base]
    if burn:
        description += f", plus {burn} us of busy Python per read"
    if patches:
        description += f", with runtime patch(es) {', '.join(patches)} (bench/experiments.py)"
    if name == "direct":
        return Running(name, upstream.port, description)
    port = free_port()
    log = workdir / f"{name}.log"
    upstream_url = f"http://{HOST}:{upstream.port}"
    running: Running
    if base in (
        "sidecar",
        "sidecar-uvloop",
        "sidecar-resume",
        "sidecar-resume-redis",
        "sidecar-otel",
        "sidecar-source",
        "sidecar-base",
    ):
        # A patched sidecar (bench.experiments) takes the same arguments.
        runner = ["bench.experiments", "+".join(patches)] if patches else ["streamwarden.cli"]
        args = [
            _base_python() if base == "sidecar-base" else sys.executable,
            "-m",
            *runner,
            "run",
            "--upstream",
            upstream_url,
            "--listen",
            f"{HOST}:{port}",
            "--admin-listen",
            f"{HOST}:{free_port()}",
        ]
        args += ["--event-loop", "asyncio"] if base == "sidecar" else ["--uvloop"]
        env: dict[str, str] = {}
        # A process the path needs whose CPU is not the sidecar's (Redis, the OTLP sink).
        companion: subprocess.Popen[bytes] | None = None
        if base == "sidecar-source":
            env["STREAMWARDEN_PURE_PYTHON"] = "1"
        if base.startswith("sidecar-resume"):
            env["STREAMWARDEN_ON_CLIENT_GONE"] = "detach"
        if base == "sidecar-resume-redis":
            companion, redis_port = _start_redis(workdir)
            env["STREAMWARDEN_RESUME_STORE"] = f"redis://{HOST}:{redis_port}/0"
        if base == "sidecar-otel":
            sink_port = free_port()
            companion = _popen(
                [sys.executable, "-m", "bench.otlp_sink", "--port", str(sink_port)],
                workdir / "otlp-sink.log",
            )
            env["STREAMWARDEN_OTEL_EXPORTER"] = "otlp-http"
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://{HOST}:{sink_port}"
        process = _popen(args, log, env={**_child_env(), **env})
        running = Running(name, port, description, process, log, [process.pid])
        running.companion = companion
        running.details["command"] = "streamwarden " + " ".join(args[args.index("run") :])
    elif name == "nginx":
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx)")
        tmp = workdir / "nginx"
        tmp.mkdir(exist_ok=True)
        conf = tmp / "nginx.conf"
        conf.write_text(
            _NGINX_CONF.format(
                tmp=tmp,
                # The descriptor limit the process really gets (the hard limit
                # may not be raisable); worker_connections above it, because at
                # equal values nginx ran out of connection slots a few hundred
                # streams before it ran out of descriptors.
                fds=(fds := procfs.raise_fd_limit()),
                connections=2 * fds,
                host=HOST,
                upstream=upstream.port,
                port=port,
            )
        )
        process = _popen([binary, "-p", str(tmp), "-c", str(conf)], log)
        running = Running(name, port, description, process, log)
        running.details["config"] = str(conf)
    elif base == "floor" or name == "floor-httptools":
        args = [
            sys.executable,
            "-m",
            "bench.floor",
            "--listen",
            f"{HOST}:{port}",
            "--upstream",
            f"{HOST}:{upstream.port}",
        ]
        if name == "floor-httptools":
            args.append("--httptools")
        if burn:
            args += ["--burn-us", burn]
        process = _popen(args, log)
        running = Running(name, port, description, process, log, [process.pid])
    elif name in ("fastapi-mw", "fastapi"):
        args = [
            sys.executable,
            "-m",
            "bench.gateway",
            "--port",
            str(port),
            "--upstream",
            upstream_url,
        ]
        if name == "fastapi-mw":
            args.append("--middleware")
        process = _popen(args, log)
        running = Running(name, port, description, process, log, [process.pid])
    else:
        raise ValueError(f"unknown path {name!r}")
    return running


def await_path(running: Running) -> Running:
    """Wait until a launched path proxies to the upstream; raise if it does not."""
    if running.process is None:
        return running
    try:
        wait_http(running.port, "/_bench/health", timeout=20.0)
    except RuntimeError:
        running.stop()
        log = running.log
        tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
        raise RuntimeError(f"{running.name} did not start:\n{tail}") from None
    if running.name == "nginx":
        assert running.process is not None
        running.measured = procfs.children(running.process.pid) or [running.process.pid]
    return running
