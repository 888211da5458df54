"""Responses that are not streams: copied to the client byte for byte.

Whatever the request asked for, a response the stream plan does not call a
stream (:mod:`streamwarden.core.plan`) keeps its status, its reason and its
headers (minus hop-by-hop ones) and its body exactly, copied by
:class:`~streamwarden.sidecar.driver.PassThrough` with the stream's flow
control and ``client_write_timeout``. Its upstream connection goes back to
the pool only if the body was read whole.
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from streamwarden.config import ResolvedRoute
from streamwarden.core.headers import drop_hop_by_hop
from streamwarden.net.upstream import Exchange
from streamwarden.sidecar.driver import PassThrough
from streamwarden.sidecar.http import CLIENT_GONE, client_channel

__all__ = ["pass_through"]


async def pass_through(
    request: web.BaseRequest, exchange: Exchange, route: ResolvedRoute
) -> web.StreamResponse:
    """Copy the upstream's answer to the client as it came."""
    upstream = exchange.head
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for name, value in drop_hop_by_hop(upstream.headers.items()):
        response.headers.add(name, value)
    copier: PassThrough | None = None
    try:
        await response.prepare(request)
        channel = client_channel(request, response)
        copier = PassThrough(channel, exchange, route.client_write_timeout)
        channel.on_gone(copier.client_gone)
        if await copier.run():
            with contextlib.suppress(*CLIENT_GONE):
                await response.write_eof()
    finally:
        if copier is not None:
            copier.finish()
        else:
            exchange.finish()
    return response
