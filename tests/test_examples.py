"""Every example in examples/ runs as its README says."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def running(*command: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        list(command), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling for the server to listen, bounded above


def streamwarden(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamwarden.cli", *args]


def test_the_fastapi_example_streams_through_the_middleware() -> None:
    port = free_port()
    with running(sys.executable, "-m", "uvicorn", "examples.fastapi_app:app", "--port", str(port)):
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/metrics")
        with httpx.stream("POST", base + "/v1/chat/completions", json={"stream": True}) as reply:
            assert reply.headers["x-accel-buffering"] == "no"
            body = b"".join(reply.iter_raw())
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"content"') == 6
        metrics = httpx.get(base + "/metrics").text
        assert 'streamwarden_streams_total{dialect="openai-chat",end_state="completed"' in metrics


def test_the_sidecar_in_front_of_a_server_serves_the_openai_sdk() -> None:
    server, proxy, admin = free_port(), free_port(), free_port()
    config = str(EXAMPLES / "in-front-of-a-server.yaml")
    with (
        running(*streamwarden("mock-upstream", "--listen", f"127.0.0.1:{server}")),
        running(
            *streamwarden(
                "run",
                "--config",
                config,
                "--listen",
                f"127.0.0.1:{proxy}",
                "--admin-listen",
                f"127.0.0.1:{admin}",
                "--set",
                f"upstream=http://127.0.0.1:{server}",
                "--set",
                f"engine_metrics_url=http://127.0.0.1:{server}/metrics",
            )
        ),
    ):
        wait_http(f"http://127.0.0.1:{admin}/healthz")
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{proxy}/v1"}
        client = subprocess.run(
            [sys.executable, str(EXAMPLES / "chat_client.py")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert client.returncode == 0, client.stderr
    assert client.stdout.startswith("Streams should stay alive")


def test_the_egress_example_reaches_the_provider_through_the_sidecar() -> None:
    provider, proxy, admin = free_port(), free_port(), free_port()
    config = str(EXAMPLES / "egress.yaml")
    with (
        running(*streamwarden("mock-upstream", "--listen", f"127.0.0.1:{provider}")),
        running(
            *streamwarden(
                "run",
                "--config",
                config,
                "--listen",
                f"127.0.0.1:{proxy}",
                "--admin-listen",
                f"127.0.0.1:{admin}",
                "--set",
                f"upstream=http://127.0.0.1:{provider}",  # the provider, simulated
            )
        ),
    ):
        wait_http(f"http://127.0.0.1:{admin}/healthz")
        env = {
            **os.environ,
            "OPENAI_API_KEY": "sk-example",
            "STREAMWARDEN_URL": f"http://127.0.0.1:{proxy}",
        }
        app = subprocess.run(
            [sys.executable, str(EXAMPLES / "egress_app.py")],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert app.returncode == 0, app.stderr
    assert app.stdout.startswith("Streams should stay alive")
    assert "(40 tokens)" in app.stdout
