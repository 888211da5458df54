"""Reading a response that must end abnormally, as a client that reads on to the end does.

A stream whose format's clients do not raise on its error event (generic
SSE, Cohere's) ends, after that event, with no terminating chunk: the
connection closes mid-body, as a broken upstream's does directly.
"""

from __future__ import annotations

import httpx
import pytest


async def read_broken(client: httpx.AsyncClient, method: str, url: str, **kwargs: object) -> bytes:
    """The body of a response read until it breaks; fail if it ends cleanly."""
    body = b""
    with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
        async with client.stream(method, url, **kwargs) as response:  # type: ignore[arg-type]
            async for part in response.aiter_raw():
                body += part
    return body
