"""The sidecar's side of resumable streams: aiohttp requests to the resume service.

Everything about a resume is :class:`~streamwarden.features.resume.service.ResumeService`'s;
this module only routes a request on a resumable route (:func:`answer_resume`:
a resume, an owner's stop, or neither), turns it into the service's
inputs, and its answer into an aiohttp response. A resume is served from
the store and never reaches the upstream: forwarding it would start a
second generation.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from streamwarden.config import ResolvedRoute
from streamwarden.core.refusals import RefusalKind
from streamwarden.features.resume.model import STREAM_ID_HEADER, Position
from streamwarden.features.resume.service import ResumeService
from streamwarden.sidecar.http import CLIENT_GONE, refuse
from streamwarden.sidecar.streams import StreamTracker

__all__ = ["answer_resume", "position", "serve_resume", "stop_stream"]


class _AiohttpAnswer:
    """An :class:`~streamwarden.features.resume.service.Answer` over an aiohttp response."""

    def __init__(self, request: web.BaseRequest, write_timeout: float) -> None:
        self.request = request
        self.response: web.StreamResponse = web.Response(status=204)
        #: A client that takes no bytes for this long is cut (client_write_timeout).
        self._write_timeout = write_timeout or None

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        if status == 204:
            return  # answered as a whole by the 204 response itself
        response = web.StreamResponse(status=status)
        for name, value in headers:
            response.headers.add(name, value)
        self.response = response
        await response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        if isinstance(self.response, web.Response):
            return
        async with asyncio.timeout(self._write_timeout):
            await self.response.write(data)

    async def finish(self) -> None:
        if not isinstance(self.response, web.Response):
            await self.response.write_eof()


async def answer_resume(
    service: ResumeService,
    tracker: StreamTracker,
    request: web.BaseRequest,
    route: ResolvedRoute,
    stream_limit: int,
) -> web.StreamResponse | None:
    """Answer a resume or a stop of a resumable route's stream; ``None`` for any other request.

    A resume holds a ``max_concurrent_streams`` slot while it is served, as
    the stream it resumes did.
    """
    asked = position(request)
    if request.method == "DELETE" and (asked is not None or STREAM_ID_HEADER in request.headers):
        return await stop_stream(service, request, asked)
    if asked is None:
        return None
    held = tracker.admit(stream_limit)
    if held is None:
        return refuse(RefusalKind.TOO_MANY_STREAMS, limit=stream_limit)
    try:
        return await serve_resume(service, request, route, asked)
    finally:
        held.release()


def position(request: web.BaseRequest) -> Position | str | None:
    """The position the request resumes from, if it is a resume."""
    return ResumeService.position(request.headers.get("Last-Event-ID"), request.query_string)


async def serve_resume(
    service: ResumeService, request: web.BaseRequest, route: ResolvedRoute, asked: Position | str
) -> web.StreamResponse:
    """Answer a resume from the store; never forwarded upstream."""
    answer = _AiohttpAnswer(request, route.client_write_timeout)
    try:
        with contextlib.suppress(*CLIENT_GONE):
            await service.serve(
                asked,
                request.headers.items(),
                request.rel_url.raw_query_string,
                request.path,
                route,
                answer,
            )
    except TimeoutError:
        # Too slow to read its replay: cut, as a slow client of a stream is.
        if request.transport is not None:
            request.transport.abort()
    return answer.response


async def stop_stream(
    service: ResumeService, request: web.BaseRequest, asked: Position | str | None
) -> web.Response:
    """``DELETE`` of a running stream by its owner: ``204``, else as if unknown."""
    if await service.stop(request.headers.items(), request.rel_url.raw_query_string, asked):
        return web.Response(status=204)
    return refuse(RefusalKind.UNKNOWN_STREAM)
