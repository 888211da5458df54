"""A real nginx on loopback: a prefix directory of its own, checked (``nginx -t``) or run.

Debian's ``nginx`` package, or a test marked ``needs_nginx`` skips, saying
how to install it. The example configs' tests (tests/config/test_configs.py)
and the probe's (tests/tools/test_probe.py) put it in front of the mock or
the sidecar.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed (Debian: apt-get install -y nginx)"
)


def nginx_prefix(tmp_path: Path, site: str) -> Path:
    """A prefix directory with a minimal nginx.conf that includes ``site`` in http {}."""
    prefix = tmp_path / "nginx"
    (prefix / "conf").mkdir(parents=True)
    (prefix / "conf" / "site.conf").write_text(site)
    temp = {name: prefix / name for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    (prefix / "conf" / "nginx.conf").write_text(
        f"pid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log info;\n"
        "worker_processes 1;\n"
        "events { worker_connections 64; }\n"
        "http {\n"
        f"    access_log {prefix}/access.log;\n"
        + "".join(f"    {name}_temp_path {path};\n" for name, path in temp.items())
        + "    include site.conf;\n"
        "}\n"
    )
    return prefix


def nginx_test(prefix: Path) -> subprocess.CompletedProcess[str]:
    assert NGINX is not None
    return subprocess.run(
        [NGINX, "-t", "-p", f"{prefix}/", "-c", "conf/nginx.conf", "-e", f"{prefix}/error.log"],
        capture_output=True,
        text=True,
        timeout=30,
    )


def free_port() -> int:
    """A loopback port free now, for nginx to listen on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def running_nginx(tmp_path: Path, site: str, port: int) -> AsyncIterator[str]:
    """Run nginx in the foreground (one process, no workers) until the block ends."""
    assert NGINX is not None
    prefix = nginx_prefix(tmp_path, site)
    process = await asyncio.create_subprocess_exec(
        NGINX,
        "-p",
        f"{prefix}/",
        "-c",
        "conf/nginx.conf",
        "-e",
        f"{prefix}/error.log",
        "-g",
        "daemon off; master_process off;",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            if process.returncode is not None or time.monotonic() > deadline:
                log = (prefix / "error.log").read_text(errors="replace")
                pytest.fail(f"nginx did not start listening on {port}:\n{log}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            break
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()
