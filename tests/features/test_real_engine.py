"""The engine counters against a real llama.cpp server, not the mock (opt-in).

Runs only when ``SWTEST_REAL_ENGINE`` names a ``llama-server``
binary (``tests/real_engine/build.sh`` builds one from the
llama-cpp-python sdist, CPU only). The model is written here, with random
weights (``tests/real_engine/tiny_model.py``, about 0.6 MB): nothing is
downloaded, the answers are noise, but the tokens are generated, streamed
and counted by the real engine.

What the real engine shows, through the sidecar (measured on a shared
2-core machine, one llama-server thread: 1300-6400 tokens/s from this model):

* When the client leaves, llama-server notices on its next write and
  releases the slot: ``llamacpp:requests_processing`` is back to 0 within
  2-6 ms of the sidecar's cancel (``streamwarden_engine_abort_seconds``;
  that includes the latency of the sidecar's own scrapes).
* It generates a few tokens nobody reads: 1-10 unseen, once 59 (a cold
  first run), against the 12000 an engine that does not abort would add.
* llama.cpp adds a request's tokens to ``llamacpp:tokens_predicted_total``
  only when its slot is released: the counter jumps at the end of the
  request, it never climbs during a stream. So the reconciliation is exact
  once both streams are over, and ``..._tokens_after_cancel_total`` is
  either 0 (the slot was released before the abort watch's first scrape)
  or the whole cancelled request's count (after it): it is printed, not
  asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from face_metrics import metric
from sidecars import StartSidecar
from streamwarden.features.engine.counters import read_engine
from waiting import wait_for, wait_until

BINARY = os.environ.get("SWTEST_REAL_ENGINE", "")
pytestmark = pytest.mark.skipif(
    not (BINARY and os.access(BINARY, os.X_OK)),
    reason=(
        "opt-in: set SWTEST_REAL_ENGINE to a llama-server binary "
        "(tests/real_engine/build.sh builds one)"
    ),
)

CHAT = "/v1/chat/completions"
#: The model's control tokens (unk, bos, eos) print nothing: banned, so that
#: every token the engine counts is a content event the sidecar counts.
BANNED = {"0": -1000, "1": -1000, "2": -1000}
#: Longer than any cancelled stream gets before the engine stops: an engine
#: that did not abort would take 2-9 s to finish it (at 1300-6400 tokens/s).
LONG_ANSWER = 12000
CONTEXT = 16384
WHOLE_ANSWER = 48
#: The engine's abort, from the sidecar's cancel to requests_processing 0:
#: measured 1.7-5.4 ms; the bound is for a loaded CI machine, and still far
#: below the seconds the rest of LONG_ANSWER would take.
ABORT_BOUND = 1.0
#: Tokens the engine generated that no stream accounts for: measured 1-59
#: (what it generated between the sidecar's last read and its own failed
#: write). The bound keeps a 5x margin over the worst, and is 40x below the
#: LONG_ANSWER tokens an engine that did not abort would add.
UNSEEN_BOUND = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    def __init__(self, process: asyncio.subprocess.Process, url: str, log: Path) -> None:
        self.process = process
        self.url = url
        self.log = log

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(self.url + "/metrics") as response:
                assert response.status == 200
                return await response.text()


@pytest.fixture
async def llama_server(tmp_path: Path) -> AsyncIterator[LlamaServer]:
    pytest.importorskip("gguf", reason="the tiny model is written with the gguf package")
    from real_engine.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny.gguf")
    port = free_port()
    log = tmp_path / "llama-server.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            BINARY,
            *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
            *("--metrics", "--no-webui", "-np", "1", "-c", str(CONTEXT), "-t", "1"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    server = LlamaServer(process, f"http://127.0.0.1:{port}", log)

    async def healthy() -> bool:
        if process.returncode is not None:
            raise AssertionError(f"llama-server exited: {log.read_text()[-3000:]}")
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(server.url + "/health") as response:
                    return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await wait_until(healthy, timeout=60, what="llama-server healthy")
        yield server
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


def request(max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "count the stream tokens"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "logit_bias": BANNED,
        "seed": 7,
        "cache_prompt": False,
    }


async def whole_stream(url: str) -> bytes:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=request(WHOLE_ANSWER)) as response:
            assert response.status == 200
            return await response.read()


async def cancel_mid_stream(url: str, after: int = 6) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=request(LONG_ANSWER)) as response:
            assert response.status == 200
            received = b""
            while received.count(b'"content":"') < after:
                chunk = await asyncio.wait_for(response.content.readany(), 10)
                assert chunk, "the stream ended before the cancel"
                received += chunk
            response.close()


def seconds(text: str) -> float:
    """The engine's own generation time, for the rate in the report line."""
    for line in text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_seconds_total "):
            return float(line.split(" ")[1])
    return float("nan")


def usage(body: bytes) -> int | None:
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            used = json.loads(line[6:]).get("usage")
            if used:
                return int(used["completion_tokens"])
    return None


async def test_llama_server_aborts_a_cancelled_stream_and_leaves_few_tokens_unseen(
    llama_server: LlamaServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(
        llama_server.url,
        engine_metrics_url=llama_server.url + "/metrics",
        engine="llamacpp",
        engine_scrape_interval="100ms",
    )
    await wait_for(
        lambda: (
            sidecar.engine_watch is not None
            and metric(sidecar, "streamwarden_engine_scrape_errors_total") == 0
        ),
        what="the watch started",
    )

    body = await whole_stream(sidecar.proxy_url)
    assert usage(body) == WHOLE_ANSWER  # ignore_eos: the whole answer, every time
    whole = sidecar.tracker.finished[-1].meter
    assert whole.end_state == "completed" and whole.tokens_generated == WHOLE_ANSWER

    await cancel_mid_stream(sidecar.proxy_url)
    await wait_for(lambda: len(sidecar.tracker.finished) == 2, what="the cancel seen")
    cancelled = sidecar.tracker.finished[-1].meter
    assert cancelled.end_state == "client_cancelled"

    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_abort_seconds_count") == 1,
        timeout=15,
        what="the abort timed",
    )
    assert metric(sidecar, "streamwarden_engine_abort_timeouts_total") == 0
    abort = metric(sidecar, "streamwarden_engine_abort_seconds_sum")
    print(f"\nllama-server abort: {abort * 1000:.1f} ms")
    assert abort < ABORT_BOUND

    # The engine's own count, once it runs nothing, against what the sidecar saw.
    text = await llama_server.metrics()
    engine = read_engine(text, "llamacpp")
    assert engine is not None and engine.running == 0
    assert engine.generated < WHOLE_ANSWER + LONG_ANSWER  # it did stop the long answer
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_generated_tokens_total") >= engine.generated,
        what="a scrape after both streams",
    )
    unseen = metric(sidecar, "streamwarden_engine_unseen_tokens_total")
    after_cancel = metric(sidecar, "streamwarden_engine_tokens_after_cancel_total")
    print(
        f"engine generated {engine.generated:.0f}, sidecar saw "
        f"{whole.tokens_generated + cancelled.tokens_generated} "
        f"(cancelled stream: {cancelled.tokens_generated}), unseen {unseen:.0f}, "
        f"after cancel {after_cancel:.0f}; {engine.generated / seconds(text):.0f} tokens/s"
    )
    assert unseen == engine.generated - whole.tokens_generated - cancelled.tokens_generated
    assert unseen < UNSEEN_BOUND
