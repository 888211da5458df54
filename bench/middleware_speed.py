"""What StreamWardenMiddleware adds per event and per non-streamed request.

Run: ``python bench/middleware_speed.py`` (add ``--e2e`` for the same
through uvicorn and a real socket; numbers in the README).

The main figures call the ASGI app directly, with and without the
middleware in front, with a server stand-in whose ``send`` does nothing:
no sockets and no server in the measurement, so the difference is the
middleware's own cost, including the core relay (SSE framing, dialect
parsing, metering). Each figure is the best of several runs, the usual way
to keep scheduler noise out of a CPU-bound measurement.

- non-streamed request: a JSON response (``http.response.start`` and one
  body message), the path every ordinary request takes;
- per event: a 2,000-event stream, one ``send`` per event, of OpenAI chat
  chunks (the dialect parses every event's JSON) and of generic events
  (framing and metering only); below each, the share of the core
  :class:`~streamwarden.core.relay.Relay` fed the same events directly.

``--e2e`` adds the median latency of sequential requests through uvicorn
(h11) and an httpx client on loopback, one keep-alive connection each,
alternating between the app without and with the middleware: the
middleware's cost next to a server's and a client's, and noisier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streamwarden.core.relay import Limits, Relay
from streamwarden.middleware import StreamWardenMiddleware

Message = dict[str, Any]
App = Callable[[dict[str, Any], Callable[[], Awaitable[Message]], Any], Awaitable[None]]

EVENTS = 2000


@dataclass(frozen=True)
class Row:
    name: str
    #: Seconds without the middleware, and with it.
    plain: float
    guarded: float
    #: Seconds the core Relay alone takes for the same work, where it applies.
    core: float | None = None


def openai_chunk(i: int) -> bytes:
    data = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


OPENAI_EVENTS = [openai_chunk(i) for i in range(EVENTS)] + [b"data: [DONE]\n\n"]
GENERIC_EVENTS = [b"data: token %d\n\n" % i for i in range(EVENTS)]
JSON_BODY = json.dumps({"answer": 42, "items": list(range(20))}).encode()


def stream_app(events: list[bytes]) -> App:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def json_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(JSON_BODY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": JSON_BODY})


def scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"bench"), (b"accept", b"*/*")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def call(app: App, path: str) -> None:
    """One request, with a server stand-in: the request, then a client that never leaves."""
    delivered = False
    forever: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await forever
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        return None

    await app(scope(path), receive, send)


async def best_of(runs: int, count: int, app: App, path: str) -> float:
    """Seconds per request, the best of ``runs`` runs of ``count`` requests."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(count):
            await call(app, path)
        best = min(best, (time.perf_counter() - started) / count)
    return best


def relay_alone(events: list[bytes], path: str, runs: int = 7) -> float:
    """Seconds per event spent in the core Relay alone (framing, dialect, meter)."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(5):
            relay = Relay(
                Limits(15.0, 60.0, 1800.0, 8 << 20),
                started_at=0.0,
                now=0.0,
                path=path,
                content_type="text/event-stream",
                headers={},
            )
            for event in events:
                relay.feed(event, 1.0)
            relay.upstream_eof(2.0)
        best = min(best, (time.perf_counter() - started) / 5 / len(events))
    return best


def guard(app: App) -> App:
    return StreamWardenMiddleware(app)  # type: ignore[arg-type, return-value]


async def direct() -> list[Row]:
    rows = []
    count = 20_000
    plain = await best_of(7, count, json_app, "/data")
    guarded = await best_of(7, count, guard(json_app), "/data")
    rows.append(Row("non-streamed request", plain, guarded))
    for name, events, path in (
        ("per event, openai-chat", OPENAI_EVENTS, "/v1/chat/completions"),
        ("per event, generic", GENERIC_EVENTS, "/stream"),
    ):
        app = stream_app(events)
        plain = await best_of(7, 5, app, path) / len(events)
        guarded = await best_of(7, 5, guard(app), path) / len(events)
        rows.append(Row(name, plain, guarded, relay_alone(events, path)))
    return rows


async def end_to_end() -> list[Row]:
    import contextlib

    import httpx
    import uvicorn

    @contextlib.asynccontextmanager
    async def serving(app: App) -> Any:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
        server.should_exit = True
        await task

    async def timed(client: httpx.AsyncClient, path: str) -> float:
        started = time.perf_counter()
        response = await client.get(path)
        await response.aread()
        return time.perf_counter() - started

    rows = []
    for name, app, path, count, divide in (
        ("non-streamed request, uvicorn", json_app, "/data", 3000, 1),
        (
            "per event, openai-chat, uvicorn",
            stream_app(OPENAI_EVENTS),
            "/v1/chat/completions",
            40,
            len(OPENAI_EVENTS),
        ),
    ):
        async with serving(app) as plain, serving(guard(app)) as guarded:
            for _ in range(max(20, count // 10)):  # warm up both
                await timed(plain, path)
                await timed(guarded, path)
            # Alternate, so that drift in the machine's load hits both alike.
            samples: tuple[list[float], list[float]] = ([], [])
            for _ in range(count):
                samples[0].append(await timed(plain, path))
                samples[1].append(await timed(guarded, path))
        rows.append(
            Row(
                name,
                statistics.median(samples[0]) / divide,
                statistics.median(samples[1]) / divide,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--e2e", action="store_true", help="also measure through uvicorn")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    rows = asyncio.run(direct())
    if args.e2e:
        rows += asyncio.run(end_to_end())
    loop = "uvloop" if args.uvloop else "asyncio"
    print(f"Python {sys.version.split()[0]}, {loop} event loop, best of 7 (uvicorn rows: medians)")
    print("| | without | with | added | of which the core Relay |")
    print("|---|---|---|---|---|")
    for row in rows:
        core = f"{row.core * 1e6:.2f} µs" if row.core is not None else ""
        print(
            f"| {row.name} | {row.plain * 1e6:.2f} µs | {row.guarded * 1e6:.2f} µs "
            f"| {(row.guarded - row.plain) * 1e6:.2f} µs | {core} |"
        )


if __name__ == "__main__":
    main()
