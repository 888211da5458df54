"""A model app streaming OpenAI chunks at a steady pace, behind the middleware, in process.

The app's generator stands in for the upstream: the middleware's resume
tests count its generations and its tokens, and the ones across replicas
serve it twice against one Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.responses import StreamingResponse

from middleware_apps import serve_in_process
from streamwarden.middleware import StreamWardenMiddleware
from streamwarden.tools.mock.tokens import mock_tokens

CHAT = "/v1/chat/completions"
TOKENS = 40


class Model:
    """A FastAPI app whose one endpoint streams OpenAI chunks at a steady pace."""

    def __init__(self, pace: float = 0.01, *, gzipped: bool = False) -> None:
        self.pace = pace
        #: The app gzips its own stream (a flush per event), as a GZip middleware
        #: told to compress event streams would.
        self.gzipped = gzipped
        self.generations = 0
        self.tokens_made = 0
        self.finished = asyncio.Event()
        self.app = FastAPI()
        self.app.post(CHAT)(self.chat)

    async def chat(self) -> StreamingResponse:
        self.generations += 1

        async def tokens() -> AsyncIterator[bytes]:
            try:
                for token in mock_tokens(TOKENS):
                    chunk = {"choices": [{"index": 0, "delta": {"content": token}}]}
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    self.tokens_made += 1
                    await asyncio.sleep(self.pace)  # the model's pace
                yield b"data: [DONE]\n\n"
            finally:
                self.finished.set()

        if not self.gzipped:
            return StreamingResponse(tokens(), media_type="text/event-stream")

        async def gzipped() -> AsyncIterator[bytes]:
            packer = zlib.compressobj(wbits=31)
            async for event in tokens():
                yield packer.compress(event) + packer.flush(zlib.Z_SYNC_FLUSH)
            yield packer.flush()

        return StreamingResponse(
            gzipped(), media_type="text/event-stream", headers={"Content-Encoding": "gzip"}
        )


@contextlib.asynccontextmanager
async def served(model: Model, **options: Any) -> AsyncIterator[tuple[str, StreamWardenMiddleware]]:
    # The middleware wrapping the app, as add_middleware builds it, held here.
    middleware = StreamWardenMiddleware(model.app, **options)
    async with serve_in_process(middleware) as url:
        yield url, middleware
