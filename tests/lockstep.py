"""An upstream in lockstep with its client: each token is written only once the one before arrived.

"Tokens arrive one by one" is a claim about order, not speed: a hop that
holds events back (a buffer, a batch, a flush at the end) holds the token
the client is waiting for, so the next one is never written and the wait
runs into its bound. No clock is read; a busy machine is only slower.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from aiohttp import web

from upstreams import serving


def token_chunk(index: int) -> bytes:
    """OpenAI's chunk for token ``index``: ``"content":"t<index> "``."""
    delta = {"content": f"t{index} "}
    data = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class Lockstep:
    """Serves ``tokens`` OpenAI chunks on any POST; token k+1 waits for :meth:`arrived` (k)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        #: Tokens written so far.
        self.written = 0
        self._arrived = -1
        self._changed = asyncio.Condition()
        self._served = contextlib.AsyncExitStack()
        self.url = ""

    async def arrived(self, index: int) -> None:
        """The client has token ``index``: the upstream may write the next one."""
        assert index < self.written, f"token {index} arrived before it was written"
        async with self._changed:
            self._arrived = max(self._arrived, index)
            self._changed.notify_all()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(self.tokens):
            async with self._changed:
                await self._changed.wait_for(lambda previous=index - 1: self._arrived >= previous)
            self.written = index + 1  # before the write: the client may have it at once
            await response.write(token_chunk(index))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def __aenter__(self) -> Lockstep:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.url = await self._served.enter_async_context(serving(app, shutdown_timeout=0.1))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._served.aclose()


async def lines_in_lockstep(lines: AsyncIterator[bytes], upstream: Lockstep) -> list[bytes]:
    """Read a stream's lines; tell ``upstream`` of each token as it arrives."""
    seen: list[bytes] = []
    async for line in lines:
        seen.append(line)
        if line.startswith(b"data: {") and b'"content":"t' in line:
            index = int(line.split(b'"content":"t', 1)[1].split(b" ", 1)[0])
            await upstream.arrived(index)
    return seen
