"""Early headers in the middleware: ``200 text/event-stream`` before the app starts, kept alive.

On a route with ``early_headers_after``, a request that asks for a stream
(the rule :class:`~streamwarden.middleware.admission.Admission` applies)
and whose app has not sent ``http.response.start`` within that time, from
the moment its body was read, gets the stream's head at once and
keep-alives while the app thinks: an app usually awaits its provider's
first byte (the whole prefill) before it starts its own response, and load
balancers cut connections that stay silent that long. As in the sidecar
(:mod:`streamwarden.sidecar.early`), the stream is opened with
:data:`~streamwarden.core.plan.EARLY_PLAN`, so its dialect comes from the path
alone, and the app's own start, when it comes, is judged by the one rule
both faces use (:func:`~streamwarden.core.plan.early_refusal`): an uncompressed
event stream has its body relayed; anything else (an error status, another
type, a compressed body) ends the stream with the dialect's error event,
and the app is stopped, as the sidecar closes such an upstream.

:class:`EarlyHead` is the timer; :class:`EarlyAnswer` stands in for the
stream's :class:`~streamwarden.middleware.body.AppBody` until the app has
answered. The responder opens the stream itself, as for any stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from streamwarden.core.lifecycle import Next
from streamwarden.core.plan import EARLY_PLAN, early_refusal
from streamwarden.core.relay import ErrorCode, Relay
from streamwarden.middleware._asgi import Message, Scope
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.body import AppBody
from streamwarden.middleware.writer import ClientWriter

__all__ = ["EARLY_HEADERS", "EARLY_START", "EarlyAnswer", "EarlyHead"]

log = logging.getLogger("streamwarden.middleware")

#: The head committed for the app, before it starts (lower-case names, as ASGI's).
EARLY_HEADERS = {"content-type": EARLY_PLAN.content_type or "text/event-stream"}
EARLY_START: Message = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (name.encode("latin-1"), value.encode("latin-1")) for name, value in EARLY_HEADERS.items()
    ],
}


class EarlyHead:
    """When one request's early head is due, and the task that commits it then."""

    __slots__ = ("_commit", "_handle", "_loop", "_task")

    def __init__(self, after: float, commit: Callable[[], Awaitable[None]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._commit = commit
        self._task: asyncio.Task[None] | None = None
        # A timer, not a sleeping task: most apps start long before it is due.
        self._handle = self._loop.call_later(after, self._due)

    def _due(self) -> None:
        self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self._commit()  # it looks for itself whether the app started meanwhile
        except Exception:
            log.exception("the early head of a stream could not be committed")

    def cancel(self) -> None:
        """The request is over: no head is due any more (call after its stream ended)."""
        self._handle.cancel()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()


class EarlyAnswer:
    """The app's messages once the early head is out: its start judged, then its body."""

    __slots__ = (
        "_app_task",
        "_body",
        "_extra_types",
        "_loop",
        "_method",
        "_relay",
        "_writer",
        "answered",
        "refused",
    )

    def __init__(
        self,
        body: AppBody,
        relay: Relay,
        writer: ClientWriter,
        app_task: AppTask,
        scope: Scope,
        extra_types: frozenset[str],
    ) -> None:
        self._body = body
        self._relay = relay
        self._writer = writer
        self._app_task = app_task
        self._method = str(scope.get("method", "GET"))
        self._extra_types = extra_types
        self._loop = asyncio.get_running_loop()
        #: The app started an event stream: its body is relayed.
        self.answered = False
        #: The app started something else: the stream ended, the rest is dropped.
        self.refused = False

    @property
    def app_closed(self) -> bool:
        """The app sent its last body message (as :attr:`AppBody.app_closed`)."""
        return self._body.app_closed

    async def commit(self, start: Message) -> None:
        """Send the early head under the writer's lock: the app's own start waits for it."""
        writer = self._writer
        async with writer.lock:
            try:
                await writer.send_head(start)
            except OSError:
                # The writer took the client as gone; the app is stopped as
                # when the inbox hears it leave (unless it runs on: drain, detach).
                if self._relay.next is not Next.READ_ON:
                    self._app_task.stop()

    async def send(self, message: Message) -> None:
        """The app's ``send()`` once the early head is out."""
        kind = message["type"]
        if self.answered:
            if kind == "http.response.body":
                await self._body.send(message)
            # Anything else (trailers) the committed head did not announce.
        elif not self.refused and kind == "http.response.start":
            await self._judge(message)
        # A refused answer's messages are dropped: the app is being stopped.

    async def _judge(self, start: Message) -> None:
        """The app's own ``http.response.start``: relay what follows, or end the stream."""
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in start.get("headers") or ()
        }
        status = int(start.get("status", 200))
        refusal = early_refusal(self._method, status, headers, self._extra_types)
        if refusal is None:
            self.answered = True
            return
        self.refused = True
        writer = self._writer
        async with writer.lock:
            if not writer.body_closed:
                now = self._loop.time()
                out = self._relay.upstream_refused(now, ErrorCode.UPSTREAM_ERROR, refusal)
                await writer.write(out, last=True, bounded=True)
        # The answer cannot follow the head: close this "upstream", as the
        # sidecar closes an upstream's late answer it refuses.
        self._app_task.stop()
