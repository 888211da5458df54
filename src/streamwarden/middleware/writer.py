"""The one writer of a middleware stream's bytes, and the client's going away.

Every write to the server (the app's body as the relay lets it out,
keep-alives and timers' error events, the end of body) goes through one
:class:`ClientWriter`, under its one lock, so two sends never overlap and
the bytes leave in the order the relay produced them. The app's own writes
are not bounded here (a timeout per event would tax every event): the
clock watches them; the clock's and the final writes are bounded by
``client_write_timeout``.

The client goes away in one of three ways, each handled here once:

- the inbox sees ``http.disconnect`` (:meth:`ClientWriter.client_disconnected`);
- a send raises ``OSError`` (ASGI 2.4 servers do, instead of or before
  reporting the disconnect);
- a bounded write times out: the client is too slow (``client_too_slow``),
  the app is stopped and the response is left unfinished, so the server
  drops the connection.

On ``on_client_gone: cancel`` the app is stopped at once, and its
unwinding is the stream's cancel propagation; on ``drain`` and ``detach``
it runs on, unaware (the inbox hides the disconnect), the relay reading
its body for the meter or the journal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from streamwarden.config import ResolvedRoute
from streamwarden.core.lifecycle import Next
from streamwarden.core.relay import Relay
from streamwarden.middleware._asgi import Message, Send
from streamwarden.middleware.admission import Admission
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.inbox import Inbox
from streamwarden.pipeline import PipelineStream
from streamwarden.pipeline.end import StreamEnd

__all__ = ["ClientWriter"]


def _nothing() -> None:
    return None


class ClientWriter:
    """Writes a stream's bytes to its client, under one lock; and hears it leave."""

    __slots__ = (
        "_admission",
        "_app_task",
        "_end",
        "_flow",
        "_inbox",
        "_loop",
        "_relay",
        "_route",
        "_server_send",
        "body_closed",
        "client_gone",
        "gone_at",
        "lock",
        "rearm_clock",
    )

    def __init__(
        self,
        server_send: Send,
        flow: PipelineStream,
        end: StreamEnd[object],
        admission: Admission,
        inbox: Inbox,
        app_task: AppTask,
    ) -> None:
        self._server_send = server_send
        self._flow = flow
        self._relay: Relay = flow.relay
        self._route: ResolvedRoute = flow.start.route
        self._end = end
        self._admission = admission
        self._inbox = inbox
        self._app_task = app_task
        self._loop = asyncio.get_running_loop()
        #: Held for every write, so that the bytes leave in the relay's order.
        self.lock = asyncio.Lock()
        #: No more writes to the client: the body ended, or the client is gone.
        self.body_closed = False
        self.client_gone = False
        #: When the client's leaving stopped the app (cancel), for its cancel propagation.
        self.gone_at: float | None = None
        #: Makes the clock look at the relay's deadline again (set by the clock's owner).
        self.rearm_clock: Callable[[], None] = _nothing

    async def send_head(self, start: Message) -> None:
        """Send the stream's ``http.response.start``, once what it waits for is done."""
        waits, self._flow.before_head = self._flow.before_head, None
        if waits is not None:
            await waits  # a resumable stream's owner in a shared store
        try:
            await self._server_send(start)
        except OSError:
            self.client_left()
            raise

    async def pass_on(self, message: Message) -> None:
        """A message that is not body (trailers were excluded at the start), in order."""
        async with self.lock:
            if not self.body_closed:
                await self._server_send(message)

    async def write(self, out: bytes, *, last: bool, bounded: bool) -> bool:
        """Send relay output; the caller holds the lock. False if the client is gone or too slow.

        ``bounded``: by ``client_write_timeout`` (the clock's and the final
        writes); the app's own writes are not.
        """
        if last:
            self.close_body()
            # BREAK: the response is left unfinished, and the server drops the
            # connection when the app returns: its client fails as it would directly.
            more = self._relay.next is Next.BREAK
        else:
            more = True
        message = {"type": "http.response.body", "body": out, "more_body": more}
        try:
            if bounded:
                async with asyncio.timeout(self._route.client_write_timeout or None):
                    await self._server_send(message)
            else:
                await self._server_send(message)
        except TimeoutError:
            self.too_slow()
            return False
        except OSError:
            # ASGI 2.4 servers raise on a closed connection instead of (or
            # before) reporting http.disconnect.
            if self.client_left() is Next.READ_ON:
                return False  # drain or detach: the app runs on, its send does not fail
            if not bounded:
                raise  # the app's own send: it hears what the server said
            self._app_task.stop()
            return False
        return True

    async def finish(self, out: bytes) -> None:
        """The last write (``out``, maybe empty) and the end of body, unless the body is closed."""
        if self.body_closed:
            return
        async with self.lock:
            if not self.body_closed:
                await self.write(out, last=True, bounded=True)

    def close_body(self) -> None:
        """No more writes to the client: its stream is over, and so is its slot.

        The slot goes back before the last bytes are handed to the server:
        a client may ask again the moment it has them (an agent loop does),
        long before the app and the middleware's helpers have unwound.
        """
        self.body_closed = True
        self._admission.release()

    # -- the client going away -----------------------------------------------

    def client_disconnected(self) -> None:
        """The inbox saw ``http.disconnect``."""
        if self.body_closed:
            # The response had ended: servers report a disconnect once it is
            # complete (uvicorn does at once). Nothing to cancel.
            return
        if self.client_left() is not Next.READ_ON:
            self._app_task.stop()

    def client_left(self) -> Next:
        """The client is gone: what the relay says follows (``READ_ON``: the app runs on).

        Otherwise the caller stops the app.
        """
        relay = self._relay
        if self.client_gone:
            return relay.next
        now = self._loop.time()
        self.client_gone = True
        self.body_closed = True  # no more writes to the client
        relay.client_gone(now)
        action = relay.next
        if action is Next.READ_ON:
            # The stream is not over: the app runs on and keeps its slot until
            # it ends (the responder gives it back then), so that
            # max_concurrent_streams bounds the generations running.
            self._inbox.hides_disconnect = True  # the app runs on, unaware
            self.rearm_clock()  # a detached stream's deadline came sooner
        else:
            self._admission.release()
        self._flow.counted_detached = self._end.count_detached(relay)
        if action is not Next.READ_ON:
            # The app is stopped because its client left: its unwinding is the
            # cancel propagation. An app that runs on (drain, detach) and is
            # stopped later, by a window or a limit, has none, as in the sidecar.
            self.gone_at = now
        return action

    def too_slow(self) -> None:
        """The client took no bytes for ``client_write_timeout``: cut, the app stopped."""
        if self.client_gone:
            return
        now = self._loop.time()
        self.client_gone = True
        self.close_body()
        self._relay.client_too_slow(now)
        self._app_task.stop()
