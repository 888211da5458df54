"""The request's receive channel, shared by the app and the middleware's disconnect watcher.

ASGI servers tell an app that its client left only through ``receive()``
(uvicorn and hypercorn never raise from ``send()``), and only one caller
may wait on ``receive()`` at a time: hypercorn hands each message to a
single waiter. So while a stream is being watched, an :class:`Inbox` is the
only caller of the server's ``receive()``, and the app's own ``receive()``
calls go through it:

- Until a stream starts, and whenever the app is itself waiting in
  ``receive()``, the app's call goes straight to the server (no task, no
  copy): request bodies keep their backpressure, and a response that is
  never streamed costs one function call per ``receive()``.
- While a stream is watched and the app is not waiting, a watcher task
  waits in the server's ``receive()``. What it gets is kept, in order, for
  the app's next call; an app that calls meanwhile waits for that result
  instead of calling the server a second time.
- ``http.disconnect``, whoever receives it, is reported once through the
  callback given to :meth:`Inbox.watch`, and from then on every ``receive()``
  answers ``http.disconnect`` at once (after any message kept before it),
  as uvicorn does; hypercorn would otherwise block a second caller forever.
  Watching again while watching only changes the callback.
- With :attr:`Inbox.hides_disconnect` set (``on_client_gone: drain`` or
  ``detach``: the app must run on without its client), the app's
  ``receive()`` never answers ``http.disconnect``: it waits until the app
  is done or stopped, so a framework that stops its generator on a
  disconnect (Starlette below ASGI 2.4) does not.

The watcher pulls request body messages eagerly when the app has not read
them before its stream started: it has to, to see the disconnect behind
them. They are kept whole until the app asks for them.

A WebSocket session's receive channel is one too (``disconnect="websocket.disconnect"``):
there the app reads the client's messages for as long as the session
lasts, so the watcher keeps at most ``hold_at_most`` of them; the server's
own queue (and the client's TCP window) holds the rest back, as it does
directly. The disconnect message the app is given is the server's own (a
WebSocket's carries its close code).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from streamwarden.middleware._asgi import Message, Receive

__all__ = ["Inbox"]

log = logging.getLogger("streamwarden.middleware")

_HTTP_DISCONNECT = "http.disconnect"


class Inbox:
    """One request's ``receive()``: the app's view of it and the disconnect watcher."""

    __slots__ = (
        "_app_waiting",
        "_changed",
        "_disconnect_type",
        "_held",
        "_hold_at_most",
        "_last",
        "_on_disconnect",
        "_receive",
        "_watcher",
        "_watcher_waiting",
        "disconnected",
        "hides_disconnect",
        "on_request",
    )

    def __init__(
        self,
        receive: Receive,
        *,
        disconnect: str = _HTTP_DISCONNECT,
        hold_at_most: int | None = None,
    ) -> None:
        self._receive = receive
        #: The type of the message that says the client left.
        self._disconnect_type = disconnect
        #: How many messages the watcher keeps for the app (``None``: all it sees).
        self._hold_at_most = hold_at_most
        #: The server's disconnect message, as every later ``receive()`` answers it.
        self._last: Message = {"type": disconnect}
        #: Messages the watcher received that the app has not asked for yet.
        self._held: deque[Message] = deque()
        #: How many of the app's calls are waiting in the server's receive().
        self._app_waiting = 0
        self._watcher: asyncio.Task[None] | None = None
        self._watcher_waiting = False
        #: Pulsed whenever a wait in the server's receive() ends.
        self._changed: asyncio.Event | None = None
        self._on_disconnect: Callable[[], None] | None = None
        #: The server has reported ``http.disconnect``.
        self.disconnected = False
        #: The app is not to hear of it (drain, detach): see the module docstring.
        self.hides_disconnect = False
        #: Called with each ``http.request`` message the app receives straight
        #: from the server (the responder looks at the request body with it).
        self.on_request: Callable[[Message], None] | None = None

    async def receive(self) -> Message:
        """The ``receive()`` handed to the app."""
        while True:
            if self._held:
                message = self._held.popleft()
                if self._hold_at_most is not None:
                    self._pulse()  # a watcher waiting for room reads on
                return message
            if self.disconnected:
                return await self._disconnect_message()
            if not self._watcher_waiting:
                break
            # The watcher is already waiting on the server; its message lands in _held.
            assert self._changed is not None
            await self._changed.wait()
        self._app_waiting += 1
        try:
            message = await self._receive()
        finally:
            self._app_waiting -= 1
            if self._changed is not None:
                self._pulse()
        if message.get("type") == self._disconnect_type:
            self._disconnect(message)
            return await self._disconnect_message()
        if self.on_request is not None:
            self.on_request(message)
        return message

    async def _disconnect_message(self) -> Message:
        if self.hides_disconnect:
            # Until the app is done or stopped (its task is cancelled then).
            await asyncio.get_running_loop().create_future()
        return dict(self._last)

    def hold(self, message: Message) -> None:
        """Give ``message``, taken from the server by the middleware, to the app's next call."""
        self._held.appendleft(message)

    def watch(self, on_disconnect: Callable[[], None]) -> None:
        """Start watching for ``http.disconnect``; ``on_disconnect`` is called once."""
        self._on_disconnect = on_disconnect
        if self.disconnected:
            on_disconnect()
            return
        if self._watcher is not None and not self._watcher.done():
            return  # already watching: only the callback changes
        if self._changed is None:
            self._changed = asyncio.Event()
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        """Stop watching; the app's later calls go to the server directly again."""
        self._on_disconnect = None
        watcher, self._watcher = self._watcher, None
        if watcher is not None and not watcher.done():
            watcher.cancel()
            # wait() rather than await: the watcher's own cancellation is expected,
            # while a cancellation of the caller must still propagate.
            await asyncio.wait((watcher,))

    # -- internals -----------------------------------------------------------

    async def _watch(self) -> None:
        changed = self._changed
        assert changed is not None
        try:
            while not self.disconnected:
                full = self._hold_at_most is not None and len(self._held) >= self._hold_at_most
                if self._app_waiting or full:
                    # The app's own call will see whatever comes next (or
                    # takes a held message, and the watcher reads on).
                    await changed.wait()
                    continue
                self._watcher_waiting = True
                try:
                    message = await self._receive()
                finally:
                    self._watcher_waiting = False
                if message.get("type") == self._disconnect_type:
                    self._disconnect(message)
                else:
                    self._held.append(message)
                self._pulse()
        except Exception:
            # A server whose receive() fails mid-request cannot be watched;
            # the stream goes on, ended by its own events and timers.
            log.debug("receive() failed while watching for a disconnect", exc_info=True)
        finally:
            self._watcher_waiting = False
            self._pulse()

    def _pulse(self) -> None:
        changed = self._changed
        if changed is not None:
            changed.set()
            changed.clear()

    def _disconnect(self, message: Message) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        self._last = message
        callback = self._on_disconnect
        if callback is not None:
            callback()
