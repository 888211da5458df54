"""Proposed hot-path changes, applied at run time, so they can be measured before src/ changes.

``python -m bench.experiments PATCHES run ...`` applies the named patches
(``+``-separated) to the installed package and then runs ``streamwarden``
with the remaining arguments. The harness starts these as paths named
``sidecar+PATCHES`` (``python -m bench experiment``) and loads them in the
same interleaved windows as the unpatched sidecar. A patch here is evidence
for a change, never the change itself: the product code stays as it is.

- ``no-gap-metrics``: no Prometheus histogram observation per content
  event (the inter-token gap); shows what that observation costs.
- ``no-batch``: the direct relay writes each HTTP chunk's events at once
  instead of one write per upstream read; shows what batching is worth.
- ``body-bytes``: a request body with a known, small length (up to 1 MiB)
  is read whole and sent upstream with its ``Content-Length`` in one write,
  instead of through an async generator as a chunked upload.

Four earlier patches proved their worth and are now the sidecar's own code
(bench/README.md tells what each gained): ``lazy-deadline`` (one deadline
timer per stream), ``direct-feed`` (the relay in the upstream's data
callback, ``streamwarden.sidecar.direct``), ``fast-cancel`` (the upstream
shut down in the callback that hears the client leave) and ``orjson``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PATCHES", "apply"]


def _no_gap_metrics() -> None:
    from streamwarden.metrics import StreamMetrics

    def observe_gap(self: StreamMetrics, seconds: float) -> None:
        return None

    StreamMetrics.observe_gap = observe_gap  # type: ignore[method-assign]


def _body_bytes() -> None:
    from aiohttp import web
    from multidict import CIMultiDict
    from yarl import URL

    from streamwarden.sidecar import proxy as proxy_module

    original = proxy_module.Proxy._open
    small = 1 << 20

    async def _open(
        self: Any, request: web.Request, url: URL, headers: CIMultiDict[str], body_start: bytes
    ) -> Any:
        length = request.content_length
        limit = self.settings.max_request_body_bytes
        if length is None or length > min(limit, small) or not request.can_read_body:
            return await original(self, request, url, headers, body_start)
        # A small body with a known length: read it, send it in one piece.
        data = body_start + await request.content.read()
        call = self.session.request(
            request.method, url, headers=headers, data=data, allow_redirects=False, compress=None
        )
        wait = self.settings.upstream_headers_timeout
        if wait > 0:
            async with asyncio.timeout(wait):
                return await call
        return await call

    proxy_module.Proxy._open = _open  # type: ignore[method-assign]


def _no_batch() -> None:
    from streamwarden.sidecar import direct

    def gather(self: Any, out: bytes) -> None:
        if out:
            self._write(out)
        if self.relay.done:
            self._wake()

    direct._Sink._gather = gather  # type: ignore[method-assign]


PATCHES: dict[str, Callable[[], None]] = {
    "no-batch": _no_batch,
    "body-bytes": _body_bytes,
    "no-gap-metrics": _no_gap_metrics,
}


def apply(names: list[str]) -> None:
    import streamwarden.dialects  # noqa: F401 - every dialect module loaded before patching

    for name in names:
        PATCHES[name]()


def main() -> int:
    patches = [p for p in sys.argv[1].split("+") if p]
    unknown = [p for p in patches if p not in PATCHES]
    if unknown:
        print(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}", file=sys.stderr)
        return 2
    apply(patches)
    from streamwarden.cli import main as streamwarden_main

    return streamwarden_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
