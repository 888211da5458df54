"""A FastAPI LLM gateway under uvicorn: the middleware path of the benchmark.

The app does what a typical Python gateway does with a provider's stream:
it forwards the request with a pooled aiohttp client and hands the
provider's body to a ``StreamingResponse`` chunk by chunk. With
``--middleware`` it adds ``StreamWardenMiddleware`` (defaults, one line),
so comparing ``fastapi`` with ``fastapi-mw`` isolates what the middleware
costs, and comparing either with ``direct`` shows what the whole Python
gateway costs.

The generator closes the provider response in its ``finally``: that is
what the middleware's cancellation relies on (it cancels the app's task
when the client leaves). Without the middleware, whether anything cancels
it while the provider is silent depends on the Starlette version and the
ASGI spec version the server reports; the cancel scenario shows what the
installed pair does.

Run: ``python -m bench.gateway --port P --upstream http://127.0.0.1:U [--middleware]``.
uvicorn picks its own defaults for the loop and the HTTP parser (uvloop
and httptools when installed, as with ``uvicorn[standard]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from bench import procfs

# The hook for the middleware face. If the package stops importing (it is
# being written alongside this harness), the gateway still runs and the
# harness reports the path as unavailable rather than failing the run.
try:
    from streamwarden.middleware import StreamWardenMiddleware
except ImportError:  # pragma: no cover - only while the middleware is broken
    StreamWardenMiddleware = None  # type: ignore[assignment,misc]

_FORWARDED = ("content-type", "accept", "authorization")


def create_app(upstream: str, *, middleware: bool) -> FastAPI:
    holder: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        holder["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        yield
        await holder["session"].close()

    app = FastAPI(lifespan=lifespan)
    if middleware:
        if StreamWardenMiddleware is None:
            raise SystemExit("streamwarden.middleware does not import")
        app.add_middleware(StreamWardenMiddleware)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED}
        target = upstream + request.url.path
        if request.url.query:
            target += "?" + request.url.query
        reply = await holder["session"].request(
            request.method, target, data=body or None, headers=headers
        )
        kind = reply.headers.get("Content-Type", "application/octet-stream")
        if not kind.startswith("text/event-stream"):
            data = await reply.read()
            reply.release()
            return Response(data, status_code=reply.status, media_type=kind)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for piece in reply.content.iter_any():
                    yield piece
            finally:
                reply.close()

        return StreamingResponse(relay(), status_code=reply.status, media_type=kind)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--middleware", action="store_true")
    args = parser.parse_args(argv)
    procfs.raise_fd_limit()
    app = create_app(args.upstream.rstrip("/"), middleware=args.middleware)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=30,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
