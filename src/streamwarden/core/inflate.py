"""Inflating a compressed body with a bounded output per step (sans-I/O).

A hostile upstream can send a few KiB of gzip that inflate to gigabytes.
``decompress(chunk)`` without a bound inflates all of it at once, in one
call that holds the whole output in memory and the event loop for seconds.
:class:`Inflater` never produces more than the caller asks for in one call
(``take(max_bytes)``); the compressed input it has not yet consumed waits in
it, so a face that stops calling ``take`` (its client is not reading, or its
turn on the event loop is used up) also stops the inflation, and the
upstream is paused until the input is consumed.

``deflate`` is meant to be zlib-wrapped (RFC 9110 section 8.4.1.2), but some
servers send raw deflate: the first bytes decide, as browsers do.
"""

from __future__ import annotations

import zlib
from collections import deque

from streamwarden.core.plan import Encoding

__all__ = ["InflateError", "Inflater"]


class InflateError(Exception):
    """The body is not valid data for its content coding."""


class Inflater:
    """Compressed bytes in (``feed``), at most ``max_bytes`` inflated bytes out per ``take``."""

    __slots__ = ("_encoding", "_finished", "_input", "_started", "_zlib")

    def __init__(self, encoding: Encoding) -> None:
        if encoding == "identity":
            raise ValueError("nothing to inflate")
        self._encoding = encoding
        # gzip: the gzip wrapper only; deflate: zlib or gzip header, auto-detected.
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else 32 + zlib.MAX_WBITS
        self._zlib = zlib.decompressobj(wbits=wbits)
        self._input: deque[bytes] = deque()
        self._started = False
        self._finished = False

    @property
    def pending(self) -> bool:
        """Whether fed input remains that ``take`` has not consumed."""
        return bool(self._input)

    def feed(self, data: bytes) -> None:
        if data and not self._finished:
            self._input.append(data)

    def take(self, max_bytes: int) -> bytes:
        """Inflate the fed input until ``max_bytes`` are produced or the input is used up."""
        out: list[bytes] = []
        room = max_bytes
        queue = self._input
        while queue and room > 0 and not self._finished:
            data = queue.popleft()
            try:
                produced = self._zlib.decompress(data, room)
            except zlib.error as exc:
                if self._started or self._encoding != "deflate":
                    raise InflateError(str(exc)) from None
                # Raw deflate without the zlib wrapper: start again without it.
                self._zlib = zlib.decompressobj(wbits=-zlib.MAX_WBITS)
                try:
                    produced = self._zlib.decompress(data, room)
                except zlib.error as again:
                    raise InflateError(str(again)) from None
            self._started = True
            tail = self._zlib.unconsumed_tail
            if tail:
                queue.appendleft(tail)  # the output bound stopped it mid-input
            elif len(produced) == room and not self._zlib.eof:
                # The bound was hit as the input ran out: zlib may hold more
                # output (a long back-reference); ask again with no new input.
                queue.appendleft(b"")
            if self._zlib.eof:
                # Anything after the end marker (unused_data) is ignored, as
                # browsers and curl do; it can never inflate the output.
                self._finished = True
                queue.clear()
            if produced:
                out.append(produced)
                room -= len(produced)
        return out[0] if len(out) == 1 else b"".join(out)
