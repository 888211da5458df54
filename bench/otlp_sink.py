"""An OTLP/HTTP endpoint that takes every export and keeps nothing (for `sidecar-otel`).

    python -m bench.otlp_sink --port 4318

What the sidecar pays for tracing is its own CPU (the spans, the SDK's
export threads); a real collector's would be its own process's, as this
one's is (not counted as the sidecar's).
"""

from __future__ import annotations

import argparse

from aiohttp import web


async def _take(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", _take)
    app.router.add_post("/v1/metrics", _take)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
