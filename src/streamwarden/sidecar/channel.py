"""The client's side of one response once its head is sent: writes, flow, departure.

The stream driver calls :meth:`ClientChannel.write` and reads
:attr:`ClientChannel.congested` once per upstream read, so the channel is
compiled with it (``setup.py``'s ``COMPILED``). It knows aiohttp's
connection only through :class:`ClientConnection`, the three things the
listener's connection class (:mod:`streamwarden.sidecar.http`) gives it,
and is built there, where that class is checked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final, Protocol

__all__ = ["ClientChannel", "ClientConnection", "ClientTransport"]

#: The chunk-size lines of the sizes most events have (``%x`` formatting
#: was about a third of a write's cost); longer writes format their own.
_HEADS: Final = [b"%x\r\n" % size for size in range(4096)]


class ClientConnection(Protocol):
    """What the channel needs of aiohttp's per-connection protocol."""

    #: Called once, in the callback that hears the client leave.
    on_client_gone: Callable[[], object] | None

    #: The transport is over its high-water mark (aiohttp's ``writing_paused``,
    #: read as its slot: the property is an interpreted call per write).
    _paused: bool

    def _drain_helper(self) -> Awaitable[None]:
        """Until the transport is back under its low-water mark (raises if the client left)."""


class ClientTransport(Protocol):
    """The client's transport (asyncio's or uvloop's, which are alike, not related)."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class ClientChannel:
    """The client's side of one response once its head is sent: writes, flow, departure.

    The stream driver writes to the client's transport itself (one write per
    upstream read, chunk-framed when the response is chunked) instead of
    awaiting ``StreamResponse.write`` per piece; aiohttp's writer still
    sends the head before and the chunked terminator after. Three things it
    needs from aiohttp's connection, which aiohttp does not expose, live
    here: a callback the moment the client leaves (in the callback that read
    its FIN or reset, three or four loop turns before aiohttp's handler
    cancellation lands), whether the transport is over its high-water mark,
    and a wait until it is not (the protocol's drain).
    """

    __slots__ = ("_connection", "_is_closing", "_transport", "_write", "chunked")

    def __init__(
        self, connection: ClientConnection, transport: ClientTransport, chunked: bool
    ) -> None:
        self._connection = connection
        self._transport = transport
        # The two calls of every write, bound once: a method called by name
        # is looked up on the transport's type at each call (about a tenth
        # of a write's own instructions).
        self._write: Callable[[bytes], None] = transport.write
        self._is_closing: Callable[[], bool] = transport.is_closing
        #: aiohttp chose chunked framing for this response (HTTP/1.1, no length).
        self.chunked = chunked

    def write(self, data: bytes) -> None:
        if len(data) and not self._is_closing():  # a length is read in place, a truth is a call
            if self.chunked:
                size = len(data)
                head = _HEADS[size] if size < 4096 else b"%x\r\n" % size
                data = head + data + b"\r\n"  # two compiled concatenations: less than a join
            self._write(data)

    def write_as_read(self, data: bytes, read: bytes) -> None:
        """Write ``data``, which ``read`` holds framed exactly as :meth:`write` would frame it."""
        if not self._is_closing():
            self._write(read if self.chunked else data)

    @property
    def congested(self) -> bool:
        """The transport is over its high-water mark: stop producing until ``writable``."""
        return self._connection._paused

    @property
    def closed(self) -> bool:
        return self._is_closing()

    async def writable(self) -> None:
        """Until the transport is back under its low-water mark (raises if the client left)."""
        await self._connection._drain_helper()

    def on_gone(self, callback: Callable[[], object] | None) -> None:
        """Run ``callback`` once, the moment the client closes or resets (``None``: stop)."""
        self._connection.on_client_gone = callback

    def abort(self) -> None:
        self._transport.abort()

    def break_off(self) -> None:
        """End the response abnormally: what was written goes out, then the connection closes.

        With no terminating chunk (aiohttp writes none to a closing
        transport), the client reads a broken body, as from an upstream
        that broke off.
        """
        self._transport.close()
