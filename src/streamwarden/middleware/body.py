"""The app's body of a middleware stream, on its way through the relay.

The app's body chunks are fed to the relay and only what it returns is
written (through the stream's :class:`~streamwarden.middleware.writer.ClientWriter`),
so a partial event is held back until its last byte arrives. A compressed
stream is inflated and relayed, as in the sidecar (:mod:`streamwarden.core.plan`
says why), a bounded step at a time: each full step is written before the
next is inflated, so a bomb costs one step of memory and waits for a slow
client like any stream.

After the stream ended (an error event, the client gone), what the app
still sends is metered (zombie tokens), never written; and every
:data:`_ZOMBIE_BURST` bytes its ``send()`` yields once, so that a pending
stop lands even in an app that awaits nothing else. A limit that ends the
stream mid-body stops the app like a gone client's.
"""

from __future__ import annotations

import asyncio

from streamwarden.core.inflate import InflateError, Inflater
from streamwarden.core.lifecycle import Next
from streamwarden.core.relay import Relay
from streamwarden.middleware._asgi import Message
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.writer import ClientWriter

__all__ = ["AppBody"]

# Most inflated bytes handed to the relay (and written) per step.
_INFLATE_STEP = 64 * 1024
# Bytes an app may send after its stream ended without waiting once: beyond
# them its send() yields, so that a pending stop can land in an app that
# awaits nothing else.
_ZOMBIE_BURST = 1 << 20


class AppBody:
    """What the app sends of a stream's body, fed to the relay, its output written."""

    __slots__ = ("_app_task", "_inflater", "_loop", "_relay", "_unyielded", "_writer", "app_closed")

    def __init__(
        self, relay: Relay, writer: ClientWriter, app_task: AppTask, inflater: Inflater | None
    ) -> None:
        self._relay = relay
        self._writer = writer
        self._app_task = app_task
        self._inflater = inflater
        self._loop = asyncio.get_running_loop()
        #: The app sent its last body message (``more_body`` false).
        self.app_closed = False
        #: Bytes the app sent after the stream ended since its send() last yielded.
        self._unyielded = 0

    async def send(self, message: Message) -> None:
        """The app's ``send()`` of a message once its stream started."""
        writer, relay = self._writer, self._relay
        if message["type"] != "http.response.body":
            await writer.pass_on(message)
            return
        body = message.get("body", b"")
        if body.__class__ is not bytes:
            body = bytes(body)  # Starlette passes an app's memoryview chunks on as they are
        more: bool = message.get("more_body", False)
        try:
            async with writer.lock:
                now = self._loop.time()
                if writer.body_closed:
                    # The stream already ended (error event, client gone): what the
                    # app still sends is metered (zombie tokens), never written. A
                    # compressed one is inflated only where the relay reads on (drain
                    # meters it, detach journals it for a resume), not just to count.
                    if body and self._inflater is None:
                        relay.feed(body, now)
                    elif body and relay.next is Next.READ_ON:
                        await self._feed_inflated(body, now)  # the gone client gets nothing
                    self.app_closed = not more
                    self._unyielded += len(body)
                    if self._unyielded < _ZOMBIE_BURST:
                        return
                    self._unyielded = 0
                    zombie_burst = True
                else:
                    zombie_burst = False
                    if self._inflater is not None:
                        out = await self._feed_inflated(body, now)
                    else:
                        out = relay.feed(body, now) if body else b""
                    if not more and not relay.done:
                        self.app_closed = True
                        out += relay.upstream_eof(self._loop.time())
                    elif not more:
                        self.app_closed = True
                    if relay.done:
                        await writer.write(out, last=True, bounded=False)
                    elif out:
                        await writer.write(out, last=False, bounded=False)
        except asyncio.CancelledError:
            if writer.body_closed and self._app_task.take_back_in_send():
                return
            raise
        if zombie_burst:
            # Outside the try: a pending stop lands here in an app that awaits
            # nothing but send().
            await asyncio.sleep(0)
            return
        if relay.done and more:
            # A limit ended the stream mid-body: stop the app like a gone client's.
            self._app_task.stop()

    async def _feed_inflated(self, body: bytes, now: float) -> bytes:
        """Inflate the app's compressed chunk a step at a time; the last step's output.

        Each full step is written before the next is inflated (under the
        lock, awaiting the server), so a bomb costs one step of memory and
        waits for a slow client like any stream.
        """
        inflater, relay = self._inflater, self._relay
        assert inflater is not None
        inflater.feed(body)
        out = b""
        while inflater.pending and not relay.done:
            if out:
                await self._writer.write(out, last=False, bounded=False)
            try:
                piece = inflater.take(_INFLATE_STEP)
            except InflateError:
                return relay.upstream_failed(self._loop.time())
            out = relay.feed(piece, self._loop.time()) if piece else b""
        return out
