"""Usage injection in the sidecar: the request side (:mod:`streamwarden.core.usage` has the rules).

:class:`UsageInjector` decides, per request, whether to ask the upstream
for usage the client did not ask for, reads the (bounded) body to rewrite
it, and remembers, per kind of request (target, host, model, credentials:
:meth:`~streamwarden.core.usage.UsageHabits.key`), what the upstream sends
when nobody asks for usage (learned from unchanged streams, before any
request of that kind is changed) and whether it refused the option: after
a ``400`` that names ``stream_options`` (:meth:`UsageInjector.look_into_refusal`)
the request is sent again as the client sent it, and that kind is left
alone for :data:`~streamwarden.core.usage.HABIT_MEMORY` seconds.
Injection is never tried behind early headers: a refusal then would
already be an error event, with nothing left to retry.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from streamwarden.config import ResolvedRoute
from streamwarden.core.dialects import SSE_MEDIA_TYPE, detect
from streamwarden.core.headers import (
    CREDENTIAL_HEADERS,
    CREDENTIAL_QUERY_PARAMETERS,
    drop_hop_by_hop,
)
from streamwarden.core.usage import (
    HabitKey,
    TakeBack,
    UsageHabits,
    UsageRole,
    refuses_stream_options,
    usage_request,
)
from streamwarden.net.upstream import Exchange, UpstreamBroken, UpstreamError

__all__ = ["Buffered", "Rewritten", "UsageInjector", "read_refusal"]

log = logging.getLogger("streamwarden.proxy")

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


@dataclass(frozen=True, slots=True)
class Rewritten:
    """A request body asking for usage, and the client's own, for a retry."""

    body: bytes
    original: bytes
    #: The request's kind: where a refusal of the option is remembered.
    kind: HabitKey


class UsageInjector:
    """Per upstream: whether to inject, and what each kind of request taught."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.habits = UsageHabits()

    def wanted(self, request: web.BaseRequest, route: ResolvedRoute) -> bool:
        """A streaming POST to an OpenAI-chat path on a route with ``usage_injection: auto``."""
        if route.usage_injection != "auto" or request.method != "POST":
            return False
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return False
        found = detect(
            route.dialect, path=request.path, content_type=SSE_MEDIA_TYPE, headers={}, framing="sse"
        )
        return found.dialect.name == "openai-chat"

    async def inject(
        self, request: web.BaseRequest, route: ResolvedRoute, start: bytes
    ) -> tuple[bytes, Rewritten | None, UsageRole]:
        """For a request that asks for a stream: its body's first bytes, read on if it may
        be rewritten; the rewritten body (``None``: the client's own); the relay's part."""
        if not request.body_exists or not self.wanted(request, route):
            return start, None, None
        start, whole = await self.read(request, start)
        if not whole:
            return start, None, None
        rewritten, usage = self.rewrite(request, start)
        return start, rewritten, usage

    async def read(self, request: web.BaseRequest, start: bytes) -> tuple[bytes, bool]:
        """The body read on from ``start``, up to the bound: (bytes, whole)."""
        parts = [start]
        size = len(start)
        content = request.content
        while not content.at_eof() and size <= self.max_body_bytes:
            chunk = await content.readany()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        whole = content.at_eof() and size <= self.max_body_bytes
        return b"".join(parts), whole

    def rewrite(self, request: web.BaseRequest, body: bytes) -> tuple[Rewritten | None, UsageRole]:
        """The body to send (``None``: the client's own) and the relay's part in it.

        A body that could carry the option is only changed for a kind whose
        habit is known; otherwise it goes as it came and its stream is
        watched to learn the habit. A request without credentials goes as
        it came and teaches nothing.
        """
        asked = usage_request(body)
        if asked is None:
            return None, None
        credentials = [
            (name.lower(), value)
            for name, value in request.headers.items()
            if name.lower() in CREDENTIAL_HEADERS
        ]
        credentials += [
            ("?" + name, value)
            for name, value in request.query.items()
            if name in CREDENTIAL_QUERY_PARAMETERS
        ]
        kind = self.habits.key(request.raw_path, request.host, asked.model, credentials)
        if kind is None:
            return None, None
        role = self.habits.role(kind, asyncio.get_running_loop().time())
        if not isinstance(role, TakeBack):
            return None, role
        return Rewritten(asked.injected, body, kind), role

    async def look_into_refusal(self, exchange: Exchange, rewritten: Rewritten) -> Buffered | None:
        """A 400 to a request the sidecar asked usage for: the option's fault, or the request's?

        If it names ``stream_options`` (old vLLM): ``None``, the client's own
        request is to go again, unchanged, and its kind is left alone for a
        while. Any other 400 (one that only quotes the request included) is
        the client's, returned to pass on as it came: sent once.
        """
        upstream = exchange.head
        text, whole = await read_refusal(exchange)
        if not refuses_stream_options(upstream.status, text):
            if not whole:
                raise UpstreamBroken("the upstream's 400 answer was cut or too long to relay")
            headers = [
                (n, v)
                for n, v in drop_hop_by_hop(upstream.headers.items())
                if n.lower() != "content-length"
            ]
            return Buffered(upstream.status, upstream.reason, headers, text)
        self.habits.refused(rewritten.kind, asyncio.get_running_loop().time())
        log.info("the upstream refused stream_options: requests of that kind go unchanged a while")
        return None


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
