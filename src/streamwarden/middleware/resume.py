"""The middleware's side of the request step: the request described, the answers written.

The pipeline's request step (:mod:`streamwarden.pipeline.step`) decides,
before the app runs, whether the middleware answers a request itself: a
whole answer (a refusal, an owner's stop) or a stream (a resume, served
from the store, never by the app). This module reads the ASGI scope into
the step's :class:`~streamwarden.pipeline.request.IncomingRequest` and
writes its answers as ASGI messages.
"""

from __future__ import annotations

import asyncio

from streamwarden.config import ResolvedRoute
from streamwarden.middleware._asgi import Message, Receive, Scope, Send
from streamwarden.middleware.inbox import Inbox
from streamwarden.pipeline.request import Answer, IncomingRequest, Serve

__all__ = ["FirstMessage", "answer", "describe", "has_body", "scope_headers"]


def scope_headers(scope: Scope) -> list[tuple[str, str]]:
    """The request headers of an ASGI scope, as text pairs."""
    return [
        (name.decode("latin-1"), value.decode("latin-1"))
        for name, value in scope.get("headers", ())
    ]


def has_body(scope: Scope) -> bool:
    """Whether the request has a body (over HTTP/2 and 3 one needs no Content-Length)."""
    if scope.get("http_version") not in ("1.0", "1.1"):
        return True
    for name, value in scope.get("headers") or ():
        name = name.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


class FirstMessage:
    """The app's request body, as the request step reads it (a RequestBody).

    The app reads its own body: the step reads only its first message, and
    only when a stream slot depends on it; the message is held for the
    app's first ``receive()``.
    """

    __slots__ = ("_inbox", "_start", "first")

    #: Read only when the step needs it.
    lazy = True

    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox
        self._start: bytes | None = None
        #: The body message read for the step, if one was.
        self.first: Message | None = None

    async def start(self) -> bytes:
        if self._start is None:
            message = await self._inbox.receive()
            self._start = b""
            if message.get("type") == "http.request":
                self._inbox.hold(message)
                self.first = message
                self._start = bytes(message.get("body", b""))
        return self._start

    async def read_on(self, start: bytes, limit: int) -> tuple[bytes, bool]:
        return start, False  # the rest is the app's to read


def describe(scope: Scope, route: ResolvedRoute, body: FirstMessage | None) -> IncomingRequest:
    """The request as the pipeline's request step sees it."""
    path: str = scope.get("path") or "/"
    query = scope.get("query_string", b"").decode("latin-1")
    raw_path: bytes = scope.get("raw_path") or path.encode("utf-8")
    target = raw_path.decode("latin-1") + ("?" + query if query else "")
    headers = scope_headers(scope)
    host = next((v for n, v in headers if n.lower() == "host"), "")
    return IncomingRequest(
        str(scope.get("method", "GET")), path, target, query, headers, route, host, None, body
    )


class _ASGIAnswer:
    """An :class:`~streamwarden.pipeline.request.AnswerWriter` over ASGI ``send``."""

    def __init__(self, send: Send, write_timeout: float) -> None:
        self._send = send
        #: A client that takes no bytes for this long is cut (client_write_timeout).
        self._write_timeout = write_timeout or None
        self.status = 200

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status
        encoded = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in headers]
        await self._send({"type": "http.response.start", "status": status, "headers": encoded})

    async def write(self, data: bytes) -> None:
        async with asyncio.timeout(self._write_timeout):
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def answer(decided: Answer | Serve, receive: Receive, send: Send) -> int:
    """Write what the step answers with; the status the client got."""
    if isinstance(decided, Serve):
        return await _serve(decided, receive, send)
    headers = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in decided.headers]
    if decided.body:
        headers.append((b"content-length", b"%d" % len(decided.body)))
    await send({"type": "http.response.start", "status": decided.status, "headers": headers})
    await send({"type": "http.response.body", "body": decided.body})
    return decided.status


async def _serve(served: Serve, receive: Receive, send: Send) -> int:
    answer = _ASGIAnswer(send, served.write_timeout)
    serving = asyncio.ensure_future(served.run(answer))
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
    return answer.status
