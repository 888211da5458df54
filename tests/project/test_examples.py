"""Every example in examples/ runs as its README says."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from locations import REPO

EXAMPLES = REPO / "examples"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def running(*command: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        list(command), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
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


@contextmanager
def sidecar_and_model(config: str, *sets: str) -> Iterator[tuple[int, int]]:
    """The simulated model, and the sidecar from ``config`` in front of it: (model, proxy) ports."""
    model, proxy, admin = free_port(), free_port(), free_port()
    assignments = [f"upstream=http://127.0.0.1:{model}", *(s.format(model=model) for s in sets)]
    with (
        running(*streamwarden("mock-upstream", "--listen", f"127.0.0.1:{model}")),
        running(
            *streamwarden(
                "run",
                "--config",
                str(EXAMPLES / config),
                "--listen",
                f"127.0.0.1:{proxy}",
                "--admin-listen",
                f"127.0.0.1:{admin}",
                *(arg for pair in assignments for arg in ("--set", pair)),
            )
        ),
    ):
        wait_http(f"http://127.0.0.1:{admin}/healthz")
        yield model, proxy


def run_example(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )


def test_the_sidecar_in_front_of_a_server_serves_the_openai_sdk() -> None:
    sets = ("engine_metrics_url=http://127.0.0.1:{model}/metrics",)
    with sidecar_and_model("in-front-of-a-server.yaml", *sets) as (_, proxy):
        client = run_example("chat_client.py", OPENAI_BASE_URL=f"http://127.0.0.1:{proxy}/v1")
    assert client.returncode == 0, client.stderr
    assert client.stdout.startswith("Streams should stay alive")


def test_the_egress_example_reaches_the_provider_through_the_sidecar() -> None:
    # The provider is simulated; the sidecar's upstream is set to it.
    with sidecar_and_model("egress.yaml") as (_, proxy):
        app = run_example(
            "egress_app.py",
            OPENAI_API_KEY="sk-example",
            SIDECAR_URL=f"http://127.0.0.1:{proxy}",
        )
    assert app.returncode == 0, app.stderr
    assert app.stdout.startswith("Streams should stay alive")
    assert "(40 tokens)" in app.stdout
