"""The middleware's side of resumable streams: ASGI requests to the resume service.

A resume or a stop never reaches the app: it is answered here, from the
store, by :class:`~streamwarden.features.resume.service.ResumeService`, the same
code the sidecar uses. This module only reads the ASGI scope and writes
the ASGI messages.
"""

from __future__ import annotations

import asyncio

from streamwarden.config import ResolvedRoute, Settings
from streamwarden.core.refusals import RefusalKind
from streamwarden.features.resume.model import STREAM_ID_HEADER, Position
from streamwarden.features.resume.service import ResumeService
from streamwarden.middleware._asgi import Receive, Scope, Send, send_refusal
from streamwarden.observation.register import StreamRegister

__all__ = ["answer_resume", "scope_headers"]


def scope_headers(scope: Scope) -> list[tuple[str, str]]:
    """The request headers of an ASGI scope, as text pairs."""
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope.get("headers", ())
    ]


class _ASGIAnswer:
    """An :class:`~streamwarden.features.resume.service.Answer` over ASGI ``send``."""

    def __init__(self, send: Send, write_timeout: float) -> None:
        self._send = send
        #: A client that takes no bytes for this long is cut (client_write_timeout).
        self._write_timeout = write_timeout or None

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        encoded = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in headers]
        await self._send({"type": "http.response.start", "status": status, "headers": encoded})

    async def write(self, data: bytes) -> None:
        async with asyncio.timeout(self._write_timeout):
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def answer_resume(
    service: ResumeService,
    settings: Settings,
    streams: StreamRegister[object],
    scope: Scope,
    receive: Receive,
    send: Send,
) -> bool:
    """Answer the request if it is a resume or a stop on a resumable route; True if it was.

    A resume is a stream like any other: it takes one of ``max_concurrent_streams``.
    """
    path: str = scope.get("path") or "/"
    route = settings.for_path(path)
    if not route.resumable:
        return False
    headers = scope_headers(scope)
    last_event_id = next((v for n, v in headers if n.lower() == "last-event-id"), None)
    query = scope.get("query_string", b"").decode("latin-1")
    asked = service.position(last_event_id, query)
    if scope.get("method") == "DELETE" and (
        asked is not None or any(n.lower() == STREAM_ID_HEADER.lower() for n, _ in headers)
    ):
        await service.ensure_started()
        if await service.stop(headers, query, asked):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send_refusal(send, RefusalKind.UNKNOWN_STREAM)
        return True
    if asked is None:
        return False
    limit = settings.max_concurrent_streams
    slot = streams.admit(limit)
    if slot is None:
        await send_refusal(send, RefusalKind.TOO_MANY_STREAMS, limit=limit)
        return True
    try:
        await _serve(service, route, asked, headers, query, path, receive, send)
    finally:
        slot.release()
    return True


async def _serve(
    service: ResumeService,
    route: ResolvedRoute,
    asked: Position | str,
    headers: list[tuple[str, str]],
    query: str,
    path: str,
    receive: Receive,
    send: Send,
) -> None:
    await service.ensure_started()
    answer = _ASGIAnswer(send, route.client_write_timeout)
    serving = asyncio.ensure_future(service.serve(asked, headers, query, path, route, answer))
    left = False

    async def watch() -> None:
        # Servers report a client that left on receive() (uvicorn's send()
        # never raises): the resume stops reading the store then.
        nonlocal left
        while (await receive()).get("type") != "http.disconnect":
            pass
        left = True
        serving.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await serving
    except asyncio.CancelledError:
        if not left:
            raise
    except (OSError, TimeoutError):
        pass  # the resumed client left too (ASGI 2.4 servers raise on send), or stalled
    finally:
        watcher.cancel()
        serving.cancel()
