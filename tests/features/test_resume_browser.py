"""A real browser's ``EventSource`` across a dropped connection.

Chromium (Debian's, driven by Playwright) loads a page that streams an
answer with ``EventSource``. The test kills the page's TCP connection
mid-answer, in a forwarder between the browser and the sidecar (the page
and the browser live on). ``EventSource`` reconnects by itself, sending
``Last-Event-ID``. Without resume the reconnect asks the model again and
the page shows the answer restarted; through a resumable route it shows
the whole answer exactly once, from one generation.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from aiohttp import web

from sidecars import StartSidecar
from streamwarden.sidecar import Sidecar
from streamwarden.tools.mock.tokens import mock_tokens
from upstreams import ServeUpstream
from waiting import wait_for, wait_until

playwright_api = pytest.importorskip("playwright.async_api")
CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium")

TOKENS = 30
ANSWER = "".join(mock_tokens(TOKENS))

PAGE = """<!doctype html>
<meta charset="utf-8">
<pre id="answer"></pre>
<script>
  window.answer = "";
  window.opened = 0;
  window.done = false;
  const source = new EventSource("/v1/chat/completions");
  source.onopen = () => { window.opened += 1; };
  source.onmessage = (message) => {
    if (message.data === "[DONE]") { source.close(); window.done = true; return; }
    const chunk = JSON.parse(message.data);
    window.answer += chunk.choices[0].delta.content || "";
    document.getElementById("answer").textContent = window.answer;
  };
</script>
"""


class Model:
    """An upstream that serves the page and streams one answer per GET, slowly."""

    def __init__(self) -> None:
        self.generations = 0
        self.app = web.Application()
        self.app.router.add_get("/page", self.page)
        self.app.router.add_get("/v1/chat/completions", self.stream)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.generations += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"retry: 100\n\n")  # reconnect quickly after a drop
        for token in mock_tokens(TOKENS):
            chunk = {"choices": [{"index": 0, "delta": {"content": token}}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.05)  # the model's pace: 20 tokens/s
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class Cutter:
    """A TCP forwarder whose connections the test can kill (the network drops)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.connections.append((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        """Kill every connection through the forwarder, both sides."""
        for client, upstream in self.connections:
            client.transport.abort()
            upstream.transport.abort()
        self.connections.clear()

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def model(serve_upstream: ServeUpstream) -> tuple[Model, str]:
    served = Model()
    return served, await serve_upstream(served.app)


async def answer_after_a_drop(sidecar: Sidecar) -> tuple[str, int]:
    """The page's answer when its connection is killed mid-stream, and its opens."""
    cutter = Cutter(sidecar.proxy_port)
    await cutter.start()
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            page = await browser.new_page()
            await page.goto(f"http://127.0.0.1:{cutter.port}/page")

            async def some_text() -> bool:
                return len(await page.evaluate("window.answer")) >= 20

            await wait_until(some_text, what="the first tokens on the page")
            cutter.cut()

            async def finished() -> bool:
                return bool(await page.evaluate("window.done"))

            await wait_until(finished, timeout=30, what="the page's answer to finish")
            answer: str = await page.evaluate("window.answer")
            opened: int = await page.evaluate("window.opened")
        finally:
            await browser.close()
            await cutter.close()
    return answer, opened


async def test_without_resume_the_page_shows_a_restarted_answer(
    model: tuple[Model, str], start_sidecar: StartSidecar
) -> None:
    served, url = model
    sidecar = await start_sidecar(url)
    answer, opened = await answer_after_a_drop(sidecar)
    assert opened == 2  # EventSource reconnected by itself
    assert served.generations == 2  # and the model was asked again
    assert answer != ANSWER and answer.endswith(ANSWER)  # the start, then all of it again


async def test_with_resume_the_page_shows_the_whole_answer_exactly_once(
    model: tuple[Model, str], start_sidecar: StartSidecar
) -> None:
    served, url = model
    sidecar = await start_sidecar(url, on_client_gone="detach")
    answer, opened = await answer_after_a_drop(sidecar)
    assert opened == 2
    assert answer == ANSWER
    assert served.generations == 1
    await wait_for(lambda: len(sidecar.tracker.finished) == 1)
    assert sidecar.tracker.finished[-1].meter.end_state == "completed"
