"""The sidecar's answers from the pipeline: aiohttp responses for what it answers itself.

The pipeline's request step decides (:mod:`streamwarden.pipeline.step`):
a whole answer (a refusal, an owner's stop) becomes an aiohttp response
(:func:`answered`); a stream it writes (a resume, served from the store,
never forwarded: that would start a second generation) is written through
an aiohttp response (:func:`serve`).
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from streamwarden.pipeline.request import Answer, Serve
from streamwarden.sidecar.http import CLIENT_GONE

__all__ = ["answered", "serve"]


class _AiohttpAnswer:
    """An :class:`~streamwarden.pipeline.request.AnswerWriter` over an aiohttp response."""

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


def answered(answer: Answer) -> web.Response:
    """A whole answer (a refusal, a stop's ``204``) as an aiohttp response."""
    response = web.Response(status=answer.status, body=answer.body or None)
    for name, value in answer.headers:
        response.headers[name] = value
    return response


async def serve(request: web.BaseRequest, served: Serve) -> web.StreamResponse:
    """Write a stream the pipeline answers with (a resume) to the client."""
    answer = _AiohttpAnswer(request, served.write_timeout)
    try:
        with contextlib.suppress(*CLIENT_GONE):
            await served.run(answer)
    except TimeoutError:
        # Too slow to read its replay: cut, as a slow client of a stream is.
        if request.transport is not None:
            request.transport.abort()
    return answer.response
