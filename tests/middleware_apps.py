"""Apps for the middleware tests, and the real servers that run them.

Importable by a server subprocess (``granian middleware_apps:app`` with
``tests/`` on ``PYTHONPATH``), so everything a test observes crosses a real
socket. ``app`` routes on its first path segment:

- ``/plain/...``: the apps as they are, no streamwarden;
- ``/guarded/...``: the same apps behind ``StreamWardenMiddleware``
  (Starlette apps through ``app.add_middleware``, the raw app wrapped);
- ``/plain-2.4/...``, ``/guarded-2.4/...``: the same, with the server
  made to announce ASGI spec 2.4 and to raise ``OSError`` from ``send()``
  once the connection is closed, as 2.4 allows. Starlette's
  ``StreamingResponse`` stops listening for disconnects at 2.4;
- ``/guarded-sendonly/...``: spec 2.4, and the disconnect is *only* told
  by ``send()`` raising: ``receive()`` never returns ``http.disconnect``.

Then ``raw``, ``starlette`` or ``sse-starlette``, then the behaviour:
``silent`` (one event, then a provider that stays silent for 30 s),
``quiet?s=`` (one event, quiet for ``s`` seconds, one more, end), ``split?pause=``
(one event written in two ``send`` calls, ``pause`` seconds apart); the raw
app also has ``raise`` (one event, then the app raises) and ``raise-quoting...``
(the same, its message quoting the request's path).

Each app's generator (or raw loop) writes ``time.monotonic()`` to
``$SWTEST_FINALLY_DIR/<id>`` in its ``finally``; CLOCK_MONOTONIC is shared
by all processes, so a test compares it with its own clock. A ``silent``
app also writes ``<id>.waiting`` as it starts to wait on its provider, so a
test can tell when the app is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

import aiohttp
import httpx
import uvicorn
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from streamwarden.middleware import StreamWardenMiddleware, mount_metrics

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The keep-alive interval of the guarded apps.
KEEPALIVE = 0.2
#: How long the "silent" provider stays silent.
SILENCE = 30.0
FINALLY_DIR_ENV = "SWTEST_FINALLY_DIR"
SSE = [(b"content-type", b"text/event-stream")]


def mark_finally(request_id: str | None) -> None:
    """Record that a generator's ``finally`` ran, and when."""
    directory = os.environ.get(FINALLY_DIR_ENV)
    if directory and request_id:
        Path(directory, request_id).write_text(repr(time.monotonic()))


async def wait_on_silent_provider(request_id: str | None) -> None:
    """Await a provider that has gone quiet, after saying so in ``<id>.waiting``."""
    directory = os.environ.get(FINALLY_DIR_ENV)
    if directory and request_id:
        Path(directory, f"{request_id}.waiting").write_text(repr(time.monotonic()))
    await asyncio.sleep(SILENCE)


def _query(scope: Scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    return {k: v[-1] for k, v in parse_qs(raw).items()}


# -- a raw ASGI app: never calls receive() ---------------------------------------


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    query = _query(scope)
    action = scope["path"].strip("/")

    async def body(data: bytes, more: bool = True) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    try:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await body(b"data: first\n\n")
        if action == "silent":
            await wait_on_silent_provider(query.get("id"))
        elif action == "quiet":
            await asyncio.sleep(float(query.get("s", "1")))
        elif action == "split":
            await body(b'data: {"half":')
            await asyncio.sleep(float(query.get("pause", "1")))
            await body(b' "two"}\n\n')
        elif action == "raise":
            raise RuntimeError("the provider broke off")
        elif action.startswith("raise-quoting"):
            # As an app's error often does: it quotes the request.
            raise RuntimeError(f"the provider broke off on {scope['path']}")
        await body(b"data: last\n\n", more=False)
    finally:
        mark_finally(query.get("id"))


# -- Starlette's StreamingResponse ----------------------------------------------------


async def _starlette_stream(request: Request) -> StreamingResponse:
    action = request.path_params["action"]
    query = request.query_params

    async def events() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            if action == "silent":
                await wait_on_silent_provider(query.get("id"))
            elif action == "quiet":
                await asyncio.sleep(float(query.get("s", "1")))
            elif action == "split":
                yield b'data: {"half":'
                await asyncio.sleep(float(query.get("pause", "1")))
                yield b' "two"}\n\n'
            yield b"data: last\n\n"
        finally:
            mark_finally(query.get("id"))

    return StreamingResponse(events(), media_type="text/event-stream")


# -- sse-starlette's EventSourceResponse -------------------------------------------


async def _sse_starlette_stream(request: Request) -> EventSourceResponse:
    query = request.query_params

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            yield {"data": "first"}
            if request.path_params["action"] == "silent":
                await wait_on_silent_provider(query.get("id"))
            yield {"data": "last"}
        finally:
            mark_finally(query.get("id"))

    # Its own pings are off so that what the client sees is streamwarden's alone.
    return EventSourceResponse(events(), ping=0)


async def _hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


def starlette_app(guarded: bool, *, sse_starlette: bool = False) -> Starlette:
    endpoint = _sse_starlette_stream if sse_starlette else _starlette_stream
    app = Starlette(routes=[Route("/hello", _hello), Route("/{action}", endpoint)])
    if guarded:
        app.add_middleware(StreamWardenMiddleware, keepalive_interval=KEEPALIVE)
        mount_metrics(app)
    return app


def build(guarded: bool) -> ASGIApp:
    """The three apps, routed by their first path segment."""
    apps: dict[str, Any] = {
        "raw": StreamWardenMiddleware(raw_app, keepalive_interval=KEEPALIVE)
        if guarded
        else raw_app,
        "starlette": starlette_app(guarded),
        "sse-starlette": starlette_app(guarded, sse_starlette=True),
    }
    return _by_first_segment(apps)


def _by_first_segment(apps: dict[str, Any]) -> ASGIApp:
    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        head, _, rest = scope["path"].lstrip("/").partition("/")
        inner = apps.get(head)
        if inner is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"no such app"})
            return
        scope = dict(scope)
        scope["path"] = "/" + rest
        scope["raw_path"] = scope["path"].encode()
        await inner(scope, receive, send)

    return route


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


# -- a server that speaks ASGI 2.4 -------------------------------------------------


def spec_24(app: ASGIApp, *, disconnect_by_receive: bool = True) -> ASGIApp:
    """Make the server look like an ASGI 2.4 one that raises from send() once closed.

    A reader task learns of the disconnect from the real server; from then on
    ``send()`` raises ``ConnectionResetError``. With ``disconnect_by_receive``
    false the app's ``receive()`` never returns ``http.disconnect``: the
    closed connection shows only as a failing ``send()``.
    """

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        scope = dict(scope)
        scope["asgi"] = {**scope.get("asgi", {}), "spec_version": "2.4"}
        inbox: asyncio.Queue[Message] = asyncio.Queue()
        closed = asyncio.Event()

        async def read() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    closed.set()
                    if not disconnect_by_receive:
                        return
                await inbox.put(message)
                if message["type"] == "http.disconnect":
                    return

        async def app_send(message: Message) -> None:
            if closed.is_set():
                raise ConnectionResetError("the client closed the connection")
            await send(message)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            await app(scope, inbox.get, app_send)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    return wrapped


app = _by_first_segment(
    {
        "plain": build(False),
        "guarded": build(True),
        "plain-2.4": spec_24(build(False)),
        "guarded-2.4": spec_24(build(True)),
        "guarded-sendonly": spec_24(build(True), disconnect_by_receive=False),
    }
)

#: The log line format of an app that configures Python logging itself.
APP_LOG_FORMAT = "APP %(levelname)s %(name)s: %(message)s"


def app_configuring_logging_late() -> ASGIApp:
    """``app``, in a process that sets up Python logging only after building it.

    For ``uvicorn --factory``: this module (and every middleware in ``app``)
    is imported first, with nothing configured, then this runs, as an app's
    lifespan handler would.
    """
    logging.basicConfig(level=logging.INFO, format=APP_LOG_FORMAT)
    return app


# -- an app in front of an inference engine ----------------------------------------------

CHAT = "/v1/chat/completions"
#: The engine (a ``streamwarden mock-upstream``) that ``engine_app`` streams from.
ENGINE_ENV = "SWTEST_ENGINE_URL"


def app_streaming_from(model_url: str) -> Starlette:
    """An app whose chat endpoint streams the model's answer, as an app in front of vLLM."""

    async def chat(request: Request) -> StreamingResponse:
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-mock-")}
        body = await request.body()

        async def answer() -> AsyncIterator[bytes]:
            # Cancelled when the client leaves: the connection to the model closes.
            async with aiohttp.ClientSession() as session:
                async with session.post(model_url + CHAT, headers=headers, data=body) as response:
                    async for chunk in response.content.iter_any():
                        yield chunk

        return StreamingResponse(answer(), media_type="text/event-stream")

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")  # what ServerProcess.wait_ready asks for

    return Starlette(
        routes=[Route(CHAT, chat, methods=["POST"]), Route("/plain/starlette/hello", hello)]
    )


def engine_app() -> ASGIApp:
    """For ``uvicorn --factory``: ``app_streaming_from($SWTEST_ENGINE_URL)``, guarded.

    The middleware's options come from the ``STREAMWARDEN_*`` environment
    (``engine_metrics_url`` among them), as in an app deployed so.
    """
    return StreamWardenMiddleware(app_streaming_from(os.environ[ENGINE_ENV]))


# -- an app in front of any provider -----------------------------------------------------

#: The headers an app passes on from the provider's streamed response.
PASSED_ON = ("content-type", "x-vercel-ai-ui-message-stream", "x-vercel-ai-data-stream")


def relaying(upstream: str) -> Starlette:
    """An app that streams its provider's answer on, chunk by chunk, as many apps do
    (the mock's controls in ``x-mock-*`` headers passed on too)."""

    async def endpoint(request: Request) -> StreamingResponse:
        client = httpx.AsyncClient(timeout=10)
        target = upstream + request.url.path + "?" + request.url.query
        controls = {k: v for k, v in request.headers.items() if k.startswith("x-mock-")}
        sent = client.build_request("POST", target, content=await request.body(), headers=controls)
        answer = await client.send(sent, stream=True)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
                await client.aclose()

        headers = {k: v for k, v in answer.headers.items() if k.lower() in PASSED_ON}
        return StreamingResponse(body(), headers=headers)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST"])])


# -- real servers in subprocesses ------------------------------------------------------

SERVERS = ("uvicorn", "hypercorn", "granian")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(server: str, port: int, target: str = "middleware_apps:app") -> list[str]:
    python = sys.executable
    if server == "uvicorn":
        return [
            python, "-m", "uvicorn", target, "--host", "127.0.0.1", "--port", str(port),
            "--no-access-log", "--timeout-graceful-shutdown", "1", "--log-level", "warning",
        ]  # fmt: skip
    if server == "hypercorn":
        return [
            python, "-m", "hypercorn", target, "--bind", f"127.0.0.1:{port}",
            "--graceful-timeout", "1", "--log-level", "warning",
        ]  # fmt: skip
    if server == "granian":
        return [
            python, "-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1", "--no-access-log", "--log-level", "warning",
            target,
        ]  # fmt: skip
    raise ValueError(server)


class ServerProcess:
    """One ASGI server in a subprocess of its own session, serving ``target`` on loopback.

    Its output (stdout and stderr) goes to ``log_path``. ``STREAMWARDEN_*``
    variables are not passed on from this process; ``environ`` adds some.
    ``arguments`` go at the end of the server's command line.
    """

    def __init__(
        self,
        server: str,
        finally_dir: Path,
        log_path: Path,
        *,
        target: str = "middleware_apps:app",
        environ: dict[str, str] | None = None,
        arguments: Sequence[str] = (),
    ) -> None:
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.finally_dir = finally_dir
        self.log_path = log_path
        tests = Path(__file__).parent
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
            FINALLY_DIR_ENV: str(finally_dir),
        }
        env = {k: v for k, v in env.items() if not k.startswith("STREAMWARDEN_")}
        env.update(environ or {})
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*server_command(server, self.port, target), *arguments],
            cwd=tests.parent,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server} exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"GET /plain/starlette/hello HTTP/1.1\r\nHost: t\r\n\r\n")
                    if sock.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.server} did not start within {timeout}s")

    def stop(self) -> None:
        """SIGTERM the server's session, then SIGKILL it if it lingers."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._log.close()


@contextlib.contextmanager
def running(server: str, workdir: Path, **options: Any) -> Iterator[ServerProcess]:
    """A :class:`ServerProcess` (``options`` are its keyword options), stopped at the end."""
    finally_dir = workdir / "finally"
    finally_dir.mkdir(parents=True, exist_ok=True)
    process = ServerProcess(server, finally_dir, workdir / f"{server}.log", **options)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


# -- a real server in the test's own process -------------------------------------------


@contextlib.asynccontextmanager
async def serve_in_process(
    app: Any, *, lifespan: Literal["on", "off"] = "off"
) -> AsyncIterator[str]:
    """Run ``app`` under uvicorn, in this process and event loop, on a free loopback port.

    Yields the base URL. The test and the app share one event loop, so the
    test can inspect the app's objects (a middleware's ``streams``) directly.
    ``lifespan="on"`` runs the app's startup before the first request and
    its shutdown when the server exits.
    """
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="critical",
        lifespan=lifespan,
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except TimeoutError:
            task.cancel()
