"""Usage injection in the sidecar: the I/O of it (the rules: :mod:`streamwarden.pipeline.usage`).

The pipeline's request step decides whether a request goes with
``stream_options.include_usage`` added (reading the body on, bounded,
through :class:`~streamwarden.sidecar.forwarding.ClientBody`); what is
left here is reading an upstream's ``400`` to such a request
(:func:`look_into_refusal`): if the rewrite says it refuses the option,
the client's own request goes once more; any other ``400`` is the
client's, passed on as it came.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from streamwarden.core.headers import drop_hop_by_hop
from streamwarden.net.upstream import Exchange, UpstreamBroken, UpstreamError
from streamwarden.pipeline.request import Rewrite

__all__ = ["Buffered", "look_into_refusal", "read_refusal"]

#: Most bytes of a 400 answer read to see whether it names the option.
REFUSAL_BODY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Buffered:
    """An upstream's answer read whole (a refusal the sidecar looked into)."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes

    def response(self) -> web.Response:
        """The answer, for the client, as it came."""
        response = web.Response(status=self.status, reason=self.reason, body=self.body)
        for name, value in self.headers:
            response.headers.add(name, value)
        return response


async def look_into_refusal(exchange: Exchange, rewritten: Rewrite) -> Buffered | None:
    """A 400 to a request the sidecar rewrote: the rewrite's fault, or the request's?

    If the rewrite says the answer refuses what it added: ``None``, the
    client's own request is to go again, unchanged. Any other 400 is the
    client's, returned to pass on as it came: sent once.
    """
    upstream = exchange.head
    text, whole = await read_refusal(exchange)
    if rewritten.refuses(upstream.status, text):
        return None
    if not whole:
        raise UpstreamBroken("the upstream's 400 answer was cut or too long to relay")
    headers = [
        (n, v)
        for n, v in drop_hop_by_hop(upstream.headers.items())
        if n.lower() != "content-length"
    ]
    return Buffered(upstream.status, upstream.reason, headers, text)


class _Collector:
    """A body sink that keeps up to a bound (a BodySink)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def body(self, chunk: bytes) -> None:
        if self.size < self.limit:
            self.parts.append(chunk[: self.limit - self.size])
        self.size += len(chunk)

    def read_done(self) -> None:
        return None

    def body_end(self) -> None:
        if not self.done.done():
            self.done.set_result(self.size <= self.limit)

    def body_broken(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.done.set_result(False)


async def read_refusal(exchange: Exchange, timeout: float = 10.0) -> tuple[bytes, bool]:
    """A refusal's body, bounded: (bytes, whole). The exchange is finished after."""
    collector = _Collector(REFUSAL_BODY_BYTES)
    exchange.attach(collector)
    try:
        async with asyncio.timeout(timeout):
            whole = await collector.done
    except TimeoutError:
        whole = False
    finally:
        exchange.finish()
    return b"".join(collector.parts), whole
