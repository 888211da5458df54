"""A FastAPI app that streams an OpenAI-style answer, with StreamWardenMiddleware added.

    uvicorn examples.fastapi_app:app --port 8000
    curl -N localhost:8000/v1/chat/completions -d '{"stream": true}'
    curl localhost:8000/metrics | grep streamwarden_streams_total

The app's own generator stands for a call to a provider. The middleware
adds the no-buffering headers, keep-alives while it is quiet, cancels it
when the client leaves, meters its tokens and turns a broken generator
into an error event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from streamwarden.middleware import StreamWardenMiddleware, mount_metrics

app = FastAPI()
app.add_middleware(StreamWardenMiddleware, keepalive_interval="5s")
mount_metrics(app)

WORDS = ["Streams", " stay", " alive", " and", " honest", "."]


@app.post("/v1/chat/completions")
async def chat() -> StreamingResponse:
    async def answer() -> AsyncIterator[bytes]:
        for word in WORDS:
            chunk = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": word}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.05)  # the model's pace
        yield b"data: [DONE]\n\n"

    return StreamingResponse(answer(), media_type="text/event-stream")
