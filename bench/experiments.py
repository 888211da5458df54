"""Proposed hot-path changes, applied at run time, so they can be measured before src/ changes.

``python -m bench.experiments PATCHES run ...`` applies the named patches
(``+``-separated) to the installed package and then runs ``streamwarden``
with the remaining arguments. The harness starts these as paths named
``sidecar+PATCHES`` (``python -m bench experiment``) and loads them in the
same interleaved windows as the unpatched sidecar. A patch here is evidence
for a change, never the change itself: the product code stays as it is.

- ``lazy-deadline``: one ``asyncio.timeout_at`` per stream instead of one
  per upstream read. The deadline (keep-alive, idle timeout, duration) is
  only ever pushed later by traffic, so the timer is left alone when it
  moves later and simply re-armed when it fires early; it is moved sooner
  only when the deadline really comes sooner. Drain still wakes the
  stream through ``ActiveStream.timer``.
- ``no-gap-metrics``: no Prometheus histogram observation per content
  event (the inter-token gap); shows what that observation costs.
- ``orjson``: the dialects parse event JSON with orjson instead of ``json``.
- ``direct-feed``: the relay runs inside the upstream connection's data
  callback and writes straight to the client transport: no StreamReader
  queue, no task wake-up, no timeout context per event (see the function).
- ``fast-cancel``: the client connection's EOF callback shuts the upstream
  socket down at once, instead of a few event-loop turns later.
- ``body-bytes``: a request body with a known, small length (up to 1 MiB)
  is read whole and sent upstream with its ``Content-Length`` in one write,
  instead of through an async generator as a chunked upload.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PATCHES", "apply"]


def _lazy_deadline() -> None:
    from aiohttp import web

    from streamwarden.sidecar import proxy as proxy_module
    from streamwarden.sidecar.streams import ActiveStream

    client_gone = proxy_module._CLIENT_GONE
    upstream_broke = proxy_module._UPSTREAM_BROKE

    async def _pump(
        self: Any,
        request: web.Request,
        upstream: Any,
        response: web.StreamResponse,
        stream: ActiveStream,
        decoder: Any,
        write_timeout: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        relay = stream.relay
        transport = request.transport
        body = upstream.content
        while not relay.done:
            out = b""
            try:
                async with asyncio.timeout_at(relay.deadline) as timer:
                    stream.timer = timer
                    while not relay.done:
                        if stream.draining:
                            out = relay.shutdown(loop.time())
                        else:
                            try:
                                chunk = await body.readany()
                            except upstream_broke:
                                out = relay.upstream_failed(loop.time())
                            else:
                                if not chunk:
                                    out = relay.upstream_eof(loop.time())
                                else:
                                    if decoder is not None:
                                        chunk = decoder.decompress(chunk)
                                    out = relay.feed(chunk, loop.time())
                        if out:
                            if transport is None or transport.get_write_buffer_size() == 0:
                                await response.write(out)
                            else:
                                try:
                                    async with asyncio.timeout(write_timeout or None):
                                        await response.write(out)
                                except TimeoutError:
                                    relay.client_too_slow(loop.time())
                                    transport.abort()
                                    return
                            out = b""
                        deadline = relay.deadline
                        when = timer.when()
                        if deadline is not None and (when is None or deadline < when):
                            timer.reschedule(deadline)
            except TimeoutError:
                now = loop.time()
                deadline = relay.deadline
                if stream.draining:
                    out = relay.shutdown(now)
                elif deadline is not None and now >= deadline:
                    out = relay.poll(now)
                # else: the timer fired at a deadline that has since moved later.
            finally:
                stream.timer = None
            if out:
                await response.write(out)
        with contextlib.suppress(*client_gone):
            await response.write_eof()

    proxy_module.Proxy._pump = _pump  # type: ignore[method-assign]


def _no_gap_metrics() -> None:
    from streamwarden.metrics import StreamMetrics

    def observe_gap(self: StreamMetrics, seconds: float) -> None:
        return None

    StreamMetrics.observe_gap = observe_gap  # type: ignore[method-assign]


def _orjson() -> None:
    import orjson

    from streamwarden import dialects
    from streamwarden.dialects import base

    def load_json(data: str) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return None

    base.load_json = load_json
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith(dialects.__name__ + ".") and hasattr(module, "load_json"):
            module.load_json = load_json  # type: ignore[attr-defined]


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


def _direct_feed() -> None:
    """Relay each upstream body chunk from inside the connection's data callback.

    The unpatched sidecar moves every event through aiohttp's StreamReader:
    the parser queues the chunk, a future wakes the stream's task, the task
    runs ``relay.feed`` under a fresh ``asyncio.timeout_at`` and awaits
    ``StreamResponse.write``. Here the reader's ``feed_data`` itself runs
    ``relay.feed`` and writes the chunk-framed result to the client
    transport, synchronously, in the same callback that read the socket; the
    stream's task only waits for the end, the timers and cancellation. What
    a real version would need besides (not done here): flow control (pause
    the upstream while the client's buffer is over its high-water mark) and
    the slow-client write timeout.
    """
    from aiohttp import streams, web

    from streamwarden.sidecar import proxy as proxy_module
    from streamwarden.sidecar.streams import ActiveStream

    hooks: dict[int, Callable[[bytes | None, BaseException | None], None]] = {}

    class HookedReader(streams.StreamReader):
        __slots__ = ()

        def feed_data(self, data: bytes, size: int = 0) -> bool:
            hook = hooks.get(id(self))
            if hook is None or not data:
                return super().feed_data(data, size)
            hook(data, None)
            return False

        def feed_eof(self) -> None:
            super().feed_eof()
            hook = hooks.get(id(self))
            if hook is not None:
                hook(None, None)

        def set_exception(self, exc: BaseException, *args: Any) -> None:
            super().set_exception(exc, *args)
            hook = hooks.get(id(self))
            if hook is not None:
                hook(None, exc)

    original = proxy_module.Proxy._pump
    client_gone = proxy_module._CLIENT_GONE

    async def _pump(
        self: Any,
        request: web.Request,
        upstream: Any,
        response: web.StreamResponse,
        stream: ActiveStream,
        decoder: Any,
        write_timeout: float,
    ) -> None:
        body = upstream.content
        client = request.transport
        chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"
        if decoder is not None or client is None or not chunked:
            return await original(self, request, upstream, response, stream, decoder, write_timeout)
        loop = asyncio.get_running_loop()
        relay = stream.relay
        ended: asyncio.Future[None] = loop.create_future()

        def deliver(out: bytes) -> None:
            if out and not client.is_closing():
                client.write(b"%x\r\n%s\r\n" % (len(out), out))
            if relay.done and not ended.done():
                ended.set_result(None)

        def hook(data: bytes | None, exc: BaseException | None) -> None:
            if relay.done:
                return
            now = loop.time()
            if exc is not None:
                deliver(relay.upstream_failed(now))
            elif data is None:
                deliver(relay.upstream_eof(now))
            else:
                deliver(relay.feed(data, now))

        # What arrived before the hook is in the reader's buffer already.
        while not relay.done and body._buffer:
            deliver(relay.feed(body.read_nowait(), loop.time()))
        if not relay.done and body.is_eof():
            deliver(relay.upstream_eof(loop.time()))
        body.__class__ = HookedReader
        hooks[id(body)] = hook
        try:
            while not relay.done:
                try:
                    async with asyncio.timeout_at(relay.deadline) as timer:
                        stream.timer = timer
                        await asyncio.shield(ended)
                except TimeoutError:
                    now = loop.time()
                    deadline = relay.deadline
                    if stream.draining:
                        deliver(relay.shutdown(now))
                    elif deadline is not None and now >= deadline:
                        deliver(relay.poll(now))
                finally:
                    stream.timer = None
        finally:
            hooks.pop(id(body), None)
        with contextlib.suppress(*client_gone):
            await response.write_eof()

    proxy_module.Proxy._pump = _pump  # type: ignore[method-assign]


def _fast_cancel() -> None:
    """Shut the upstream socket inside the callback that hears the client leave.

    Unpatched, the upstream's FIN leaves several loop turns after the
    client's: EOF read, transport close (next turn), ``connection_lost``
    cancels the handler task (next turn), the ``CancelledError`` unwinds
    the handler's coroutines, ``ClientResponse.close`` closes the transport
    (next turn), and only then the socket. Here the client protocol's
    ``eof_received``/``connection_lost`` shuts the upstream socket down at
    once (``shutdown(SHUT_RDWR)`` sends the FIN now); the handler is still
    cancelled as before and does its accounting as before.
    """
    import socket

    from aiohttp import web, web_protocol

    from streamwarden.sidecar import proxy as proxy_module
    from streamwarden.sidecar.streams import ActiveStream

    streams_by_protocol: dict[int, ActiveStream] = {}

    def shut_upstream(protocol: object) -> None:
        stream = streams_by_protocol.pop(id(protocol), None)
        response = getattr(stream.on_close, "__self__", None) if stream else None
        connection = getattr(response, "connection", None)
        transport = getattr(connection, "transport", None)
        if transport is None:
            return
        fd = transport.get_extra_info("socket").fileno()
        if fd < 0:
            return
        # A socket object over the same descriptor, detached so it never closes it.
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()

    original_eof = web_protocol.RequestHandler.eof_received
    original_lost = web_protocol.RequestHandler.connection_lost

    def eof_received(self: web_protocol.RequestHandler) -> None:
        shut_upstream(self)
        return original_eof(self)

    def connection_lost(self: web_protocol.RequestHandler, exc: BaseException | None) -> None:
        shut_upstream(self)
        return original_lost(self, exc)

    web_protocol.RequestHandler.eof_received = eof_received  # type: ignore[method-assign]
    web_protocol.RequestHandler.connection_lost = connection_lost  # type: ignore[method-assign]

    original_run = proxy_module.Proxy._run_stream

    async def _run_stream(
        self: Any,
        request: web.Request,
        route: Any,
        relay: Any,
        status: int,
        pump: Callable[[ActiveStream], Any],
    ) -> None:
        key = id(request.protocol)

        async def registered(stream: ActiveStream) -> None:
            streams_by_protocol[key] = stream
            await pump(stream)

        try:
            await original_run(self, request, route, relay, status, registered)
        finally:
            streams_by_protocol.pop(key, None)

    proxy_module.Proxy._run_stream = _run_stream  # type: ignore[method-assign]


PATCHES: dict[str, Callable[[], None]] = {
    "fast-cancel": _fast_cancel,
    "direct-feed": _direct_feed,
    "body-bytes": _body_bytes,
    "lazy-deadline": _lazy_deadline,
    "no-gap-metrics": _no_gap_metrics,
    "orjson": _orjson,
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
