"""The inference engine's own counters against a face's (``engine_metrics_url``).

The mock serves engine metrics in vLLM's (or SGLang's) names and, with
``--no-abort``, keeps generating after its client leaves, as some
llama.cpp server versions did. The face's own accounting cannot see
that generation: the stream was cancelled, the socket closed. Reconciled
against the engine's counter, those tokens show up as unseen, and the
time the engine takes to stop after a cancel is measured. The sidecar
proxies to the mock; the middleware guards an app (under uvicorn, its
lifespan on) that streams from the mock, as an app next to a vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from face_metrics import metric, samples
from middleware_apps import CHAT, ENGINE_ENV, app_streaming_from, running, serve_in_process
from sidecars import StartSidecar
from streamwarden.features.engine.counters import read_engine
from streamwarden.features.engine.peers import EngineWatchers
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock import MockServer, MockSettings, start_mock
from upstreams import ServeUpstream
from waiting import wait_for, wait_until

VLLM = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="a"} 100.0
vllm:generation_tokens_total{model_name="b"} 20.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
"""
SGLANG = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 7.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 1.0
"""
TGI = """# TYPE tgi_request_generated_tokens histogram
tgi_request_generated_tokens_bucket{le="+Inf"} 2
tgi_request_generated_tokens_sum 55
tgi_request_generated_tokens_count 2
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 0
"""
LLAMACPP = """# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 9
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
"""


@pytest.mark.parametrize(
    ("text", "engine", "generated", "running"),
    [
        (VLLM, "vllm", 120.0, 3.0),
        (SGLANG, "sglang", 7.0, 1.0),
        (TGI, "tgi", 55.0, 0.0),
        (LLAMACPP, "llamacpp", 9.0, 2.0),
    ],
)
def test_each_engines_names_are_read_and_found_by_auto(
    text: str, engine: str, generated: float, running: float
) -> None:
    for asked in (engine, "auto"):
        reading = read_engine(text, asked)
        assert reading is not None
        assert (reading.engine, reading.generated, reading.running) == (engine, generated, running)


@pytest.mark.parametrize("text", ["", "garbage {{{", "# TYPE x counter\nx_total 1\n", "\xff" * 100])
def test_text_without_a_known_counter_is_no_reading(text: str) -> None:
    assert read_engine(text) is None


@pytest.fixture
async def engine() -> AsyncIterator[Callable[..., Awaitable[MockServer]]]:
    started: list[MockServer] = []

    async def start(**settings: Any) -> MockServer:
        server = await start_mock(settings=MockSettings(**settings))
        started.append(server)
        return server

    yield start
    for server in started:
        await server.close()


async def cancel_mid_stream(url: str, request_id: str) -> None:
    headers = {"x-mock-request-id": request_id, "x-mock-ttft": "0", "x-mock-tokens": "60"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=headers, json={"stream": True}) as response:
            received = b""
            while received.count(b'"content":"') < 6:
                received += await response.content.readany()
            response.close()


async def whole_stream(url: str, request_id: str) -> None:
    headers = {"x-mock-request-id": request_id, "x-mock-ttft": "0", "x-mock-tokens": "20"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, headers=headers, json={"stream": True}) as response:
            await response.read()


async def test_an_engine_that_aborts_leaves_nothing_unseen_and_nothing_after_the_cancel(
    engine: Callable[..., Awaitable[MockServer]], start_sidecar: StartSidecar
) -> None:
    model = await engine(tokens_per_second=50)
    sidecar = await start_sidecar(
        model.url, engine_metrics_url=model.url + "/metrics", engine_scrape_interval="100ms"
    )
    await whole_stream(sidecar.proxy_url, "whole")
    await cancel_mid_stream(sidecar.proxy_url, "cancelled")
    await model.stats.wait_ended("cancelled")
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_abort_seconds_count") == 1,
        what="the abort timed",
    )
    # Timed, not given up on: the engine stopped, and generated nothing meanwhile.
    assert metric(sidecar, "streamwarden_engine_abort_timeouts_total") == 0
    assert metric(sidecar, "streamwarden_engine_tokens_after_cancel_total") == 0
    generated = sum(r.tokens_generated for r in model.stats.records)  # the mock's own count
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_generated_tokens_total") >= generated,
        what="a scrape after both streams",
    )
    assert metric(sidecar, "streamwarden_engine_unseen_tokens_total") == 0


async def test_an_engine_that_does_not_abort_shows_its_zombie_tokens_as_unseen(
    engine: Callable[..., Awaitable[MockServer]], start_sidecar: StartSidecar
) -> None:
    model = await engine(tokens_per_second=100, abort_on_disconnect=False)
    sidecar = await start_sidecar(
        model.url, engine_metrics_url=model.url + "/metrics", engine_scrape_interval="100ms"
    )
    await wait_for(
        lambda: (
            metric(sidecar, "streamwarden_engine_scrape_errors_total") == 0
            and sidecar.engine_watch is not None
        ),
        what="the watch started",
    )
    await cancel_mid_stream(sidecar.proxy_url, "zombie")
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    meter = sidecar.tracker.finished[-1].meter
    # What the sidecar itself knows: a cancelled stream, a few zombie tokens at most.
    assert meter.end_state == "client_cancelled" and meter.tokens_generated < 20
    # The engine went on to the end of its 60-token answer, for nobody.
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_unseen_tokens_total") >= 40,
        timeout=15,
        what="the engine's zombie tokens reconciled as unseen",
    )
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_abort_seconds_count") == 1,
        timeout=15,
        what="the abort timed",
    )
    # Its stop came only after the rest of the answer, generated for nobody.
    assert metric(sidecar, "streamwarden_engine_tokens_after_cancel_total") >= 40


async def test_an_engine_that_cannot_be_scraped_never_touches_a_stream(
    mock: MockServer, start_sidecar: StartSidecar
) -> None:
    sidecar = await start_sidecar(
        mock.url, engine_metrics_url=mock.url + "/nothing-here", engine_scrape_interval="50ms"
    )
    await wait_for(
        lambda: metric(sidecar, "streamwarden_engine_scrape_errors_total") >= 2,
        what="failed scrapes counted",
    )
    await whole_stream(sidecar.proxy_url, "fine")
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"


async def test_a_metrics_page_longer_than_one_read_is_read_to_its_end(
    mock: MockServer, start_sidecar: StartSidecar, serve_upstream: ServeUpstream
) -> None:
    # vLLM's page runs to hundreds of KiB (a histogram per model and label);
    # the counter may come last.
    filler = "# TYPE vllm:filler gauge\n" + "".join(
        f'vllm:filler{{model_name="m{i}"}} 1.0\n' for i in range(20_000)
    )
    page = (filler + VLLM).encode()

    # The rest of the page waits until the direct reader has had its first read.
    released = asyncio.Event()

    async def metrics(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4"})
        await response.prepare(request)
        piece = 64 * 1024
        await response.write(page[:piece])
        await released.wait()
        with contextlib.suppress(ConnectionResetError):  # the direct reader has gone
            for at in range(piece, len(page), piece):
                await response.write(page[at : at + piece])
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    url = await serve_upstream(app) + "/metrics"
    # Without streamwarden's reader: aiohttp's read(n) is what has arrived so far.
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            first = await response.content.read(len(page) + 1)
    released.set()
    assert len(first) < len(page)
    assert read_engine(first.decode()) is None
    sidecar = await start_sidecar(mock.url, engine_metrics_url=url)
    assert sidecar.engine_watch is not None
    reading = await sidecar.engine_watch.read()
    assert reading is not None and reading.generated == 120.0


# -- the middleware ---------------------------------------------------------------


def guarded(model: MockServer, **options: Any) -> StreamWardenMiddleware:
    return StreamWardenMiddleware(
        app_streaming_from(model.url),
        engine_metrics_url=model.url + "/metrics",
        engine_scrape_interval="100ms",
        **options,
    )


async def test_through_the_middleware_an_engine_that_aborts_leaves_nothing_unseen(
    engine: Callable[..., Awaitable[MockServer]],
) -> None:
    model = await engine(tokens_per_second=50)
    middleware = guarded(model, metrics_path="/metrics")
    watch = middleware.engine_watch
    assert watch is not None and not watch.running
    async with serve_in_process(middleware, lifespan="on") as url:
        assert watch.running  # started by the lifespan's startup, before any request
        await whole_stream(url, "whole")
        await cancel_mid_stream(url, "cancelled")
        await model.stats.wait_ended("cancelled")
        await wait_for(
            lambda: metric(middleware, "streamwarden_engine_abort_seconds_count") == 1,
            what="the abort timed",
        )
        assert metric(middleware, "streamwarden_engine_abort_timeouts_total") == 0
        assert metric(middleware, "streamwarden_engine_tokens_after_cancel_total") == 0
        generated = sum(r.tokens_generated for r in model.stats.records)
        await wait_for(
            lambda: metric(middleware, "streamwarden_engine_generated_tokens_total") >= generated,
            what="a scrape after both streams",
        )
        assert metric(middleware, "streamwarden_engine_unseen_tokens_total") == 0
        # The same families, where the app's Prometheus scrapes the middleware.
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as response:
                served = samples(await response.text())
        assert served["streamwarden_engine_abort_seconds_count"] == 1
        assert served["streamwarden_engine_unseen_tokens_total"] == 0
    assert not watch.running  # stopped by the lifespan's shutdown


async def test_through_the_middleware_an_engine_that_does_not_abort_shows_its_zombie_tokens(
    engine: Callable[..., Awaitable[MockServer]],
) -> None:
    model = await engine(tokens_per_second=100, abort_on_disconnect=False)
    middleware = guarded(model)
    async with serve_in_process(middleware, lifespan="on") as url:
        await cancel_mid_stream(url, "zombie")
        await wait_for(lambda: len(middleware.streams.finished) == 1)
        meter = middleware.streams.finished[-1].meter
        # What the middleware itself knows: a cancelled stream, a few zombie tokens at most.
        assert meter.end_state == "client_cancelled" and meter.tokens_generated < 20
        # The engine went on to the end of its 60-token answer, for nobody.
        await wait_for(
            lambda: metric(middleware, "streamwarden_engine_unseen_tokens_total") >= 40,
            timeout=15,
            what="the engine's zombie tokens reconciled as unseen",
        )
        await wait_for(
            lambda: metric(middleware, "streamwarden_engine_abort_seconds_count") == 1,
            timeout=15,
            what="the abort timed",
        )
        assert metric(middleware, "streamwarden_engine_tokens_after_cancel_total") >= 40


async def test_without_a_lifespan_the_first_request_starts_the_watch(
    engine: Callable[..., Awaitable[MockServer]],
) -> None:
    model = await engine(tokens_per_second=200)
    middleware = guarded(model)
    assert middleware.engine_watch is not None
    async with serve_in_process(middleware, lifespan="off") as url:
        assert not middleware.engine_watch.running
        await whole_stream(url, "first")
        assert middleware.engine_watch.running
        await wait_for(
            lambda: metric(middleware, "streamwarden_engine_generated_tokens_total") >= 20,
            what="a scrape after the stream",
        )
        assert metric(middleware, "streamwarden_engine_unseen_tokens_total") == 0
    await middleware.close()


class CountingEngine:
    """An engine's ``/metrics`` that counts its scrapes and its open connections.

    Its gauge says three requests run, whatever happens: after a cancel the
    watch polls it every 10 ms until its 5 s bound, so a close arrives while
    the watch is timing an abort.
    """

    def __init__(self) -> None:
        self.scrapes = 0
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/metrics"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        page = VLLM.encode()
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n"
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")  # a GET: no body
                self.scrapes += 1
                writer.write(head % len(page) + page)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the watch closed its connection
        finally:
            self.connections -= 1
            writer.close()


def middleware_tasks() -> list[str]:
    """The tasks the middleware runs beside the app: the engine watch's, by their coroutine."""
    names = (getattr(task.get_coro(), "__qualname__", "") for task in asyncio.all_tasks())
    return sorted(name for name in names if name.startswith("EngineWatch."))


async def test_without_a_lifespan_close_stops_what_the_first_request_started() -> None:
    metrics_page = CountingEngine()
    url_of_metrics = await metrics_page.start()
    provider_waiting = asyncio.Event()

    async def chat(request: Request) -> StreamingResponse:
        async def answer() -> AsyncIterator[bytes]:
            yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
            provider_waiting.set()
            await asyncio.Event().wait()  # a provider that goes quiet: the client leaves
            yield b"data: [DONE]\n\n"

        return StreamingResponse(answer(), media_type="text/event-stream")

    middleware = StreamWardenMiddleware(
        Starlette(routes=[Route(CHAT, chat, methods=["POST"])]),
        engine_metrics_url=url_of_metrics,
        engine_scrape_interval="50ms",
    )
    try:
        async with serve_in_process(middleware, lifespan="off") as url:
            assert metrics_page.scrapes == 0 and middleware_tasks() == []
            async with aiohttp.ClientSession() as session:
                async with session.post(url + CHAT, json={"stream": True}) as response:
                    await response.content.readuntil(b"\n\n")
                    await provider_waiting.wait()
            # The client left: the watch times the engine's abort (it never comes).
            await wait_for(
                lambda: (
                    middleware_tasks()
                    == ["EngineWatch._scrape_forever", "EngineWatch._time_aborts"]
                ),
                what="the watch scraping and timing the abort",
            )
            assert metrics_page.scrapes >= 1 and metrics_page.connections >= 1
        # The server has stopped: nothing of the server's stops the middleware's tasks.
        assert middleware_tasks() != []
        await middleware.close()
        assert middleware_tasks() == []
        await wait_for(lambda: metrics_page.connections == 0, what="the engine's connections")
        await middleware.close()  # closing twice is no error
        assert middleware.engine_watch is not None and not middleware.engine_watch.running
        # A request after the close is served, and restarts nothing.
        async with serve_in_process(middleware, lifespan="off") as url:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/nothing") as response:
                    assert response.status == 404
            assert middleware_tasks() == []
    finally:
        await metrics_page.close()


# -- several workers on one engine ------------------------------------------------


def test_watches_of_one_engine_count_each_other_and_not_the_dead(tmp_path: Path) -> None:
    url = "http://127.0.0.1:8000/metrics"
    first, second = EngineWatchers(url, str(tmp_path)), EngineWatchers(url, str(tmp_path))
    elsewhere = EngineWatchers("http://127.0.0.1:8001/metrics", str(tmp_path))
    for watch in (first, second, elsewhere):
        watch.join()
    assert (first.count(), second.count(), elsewhere.count()) == (2, 2, 1)
    # A watch whose process died leaves its file, unlocked: not counted, and removed.
    (directory,) = [d for d in tmp_path.glob("*/engine-watch-*") if len(list(d.iterdir())) == 2]
    dead = directory / "12345-dead"
    dead.touch()
    assert first.count() == 2 and not dead.exists()
    second.leave()
    assert first.count() == 1 and len(list(directory.iterdir())) == 1
    first.leave()
    elsewhere.leave()


async def served_metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            return samples(await response.text())


async def test_two_workers_on_one_engine_claim_none_of_each_others_tokens(
    engine: Callable[..., Awaitable[MockServer]], tmp_path: Path
) -> None:
    # Two uvicorn processes of one app, each with its middleware and watch, on
    # one engine that aborts on every cancel: no token is anybody's zombie.
    model = await engine(tokens_per_second=400)
    environ = {
        ENGINE_ENV: model.url,
        "STREAMWARDEN_ENGINE_METRICS_URL": model.url + "/metrics",
        "STREAMWARDEN_ENGINE_SCRAPE_INTERVAL": "50ms",
        "STREAMWARDEN_METRICS_PATH": "/metrics",
    }
    options: dict[str, Any] = {
        "target": "middleware_apps:engine_app",
        "environ": environ,
        "arguments": ["--factory"],
    }
    with running("uvicorn", tmp_path / "a", **options) as a:
        with running("uvicorn", tmp_path / "b", **options) as b:
            # Each watch has read the engine (its baseline) and counted both.
            for worker in (a.url, b.url):
                await wait_until(
                    lambda worker=worker: _reached(  # type: ignore[misc]
                        worker, "streamwarden_engine_watches", 2, exactly=True
                    ),
                    what="each worker counting both watches",
                )
            await whole_stream(b.url, "through-b")
            await wait_until(
                lambda: _reached(b.url, "streamwarden_engine_generated_tokens_total", 20),
                what="b's watch saw its own stream in the engine",
            )
            await whole_stream(a.url, "through-a")
            for worker in (a.url, b.url):
                await wait_until(
                    lambda worker=worker: _reached(  # type: ignore[misc]
                        worker, "streamwarden_engine_generated_tokens_total", 40
                    ),
                    what="a scrape after both streams",
                )
                # Without the count of watches, b took a's 20 tokens for zombies.
                metrics_of = await served_metrics(worker)
                assert metrics_of["streamwarden_engine_unseen_tokens_total"] == 0, worker
            # b dies without leaving (SIGKILL): the kernel drops its lock with it.
            os.killpg(b.proc.pid, signal.SIGKILL)
            b.proc.wait(timeout=10)
            await wait_until(
                lambda: _reached(a.url, "streamwarden_engine_watches", 1, exactly=True),
                what="a alone on the engine",
            )
            # Alone, a reconciles again, from a new baseline: a stream that
            # bypasses it is unseen, and nothing of b's past is.
            await whole_stream(model.url, "bypassing")
            await wait_until(
                lambda: _reached(a.url, "streamwarden_engine_generated_tokens_total", 60),
                what="a scrape after the bypassing stream",
            )
            metrics_of = await served_metrics(a.url)
            assert metrics_of["streamwarden_engine_unseen_tokens_total"] == 20


async def _reached(url: str, name: str, value: float, exactly: bool = False) -> bool:
    served = (await served_metrics(url)).get(name, 0.0)
    return served == value if exactly else served >= value
