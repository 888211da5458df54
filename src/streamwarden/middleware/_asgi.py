"""The ASGI types the middleware speaks, spelled out so that nothing imports Starlette.

ASGI messages are plain dicts; these aliases only give them names for the
type checker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeAlias

from streamwarden.core.refusals import RefusalKind

__all__ = ["ASGIApp", "Message", "Receive", "Scope", "Send", "send_refusal"]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_refusal(send: Send, kind: RefusalKind, **values: object) -> None:
    """Answer with one of the refusals a face gives itself (the table is in refusals)."""
    refused = kind.refusal
    body = refused.body(**values)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    headers += [(n.lower().encode(), v.encode()) for n, v in refused.headers]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
