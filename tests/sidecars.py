"""Real sidecars on free loopback ports, all closed at the end (for fixtures of any loop scope)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from streamwarden.config import load_settings
from streamwarden.sidecar import Sidecar

#: ``start(upstream, **settings)``: a sidecar on free loopback ports, closed after the test.
#: The one type every test module takes its ``start_sidecar`` fixture as.
StartSidecar = Callable[..., Awaitable[Sidecar]]


@contextlib.asynccontextmanager
async def sidecars() -> AsyncIterator[StartSidecar]:
    """A ``start(upstream, **settings)`` for sidecars that are all closed on exit."""
    started: list[Sidecar] = []

    async def start(upstream: str, **overrides: Any) -> Sidecar:
        settings = load_settings(
            environ={},
            overrides={
                "upstream": upstream,
                "listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",
                **overrides,
            },
        )
        sidecar = Sidecar(settings)
        await sidecar.start()
        started.append(sidecar)
        return sidecar

    try:
        yield start
    finally:
        for sidecar in started:
            await sidecar.close()
