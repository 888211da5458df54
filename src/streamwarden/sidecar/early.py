"""Early headers: ``200 text/event-stream`` before the upstream answers, kept alive.

On a route with ``early_headers_after``, a request that asks for a stream
and whose upstream has not answered within that time gets its response
head at once, and keep-alives while the upstream thinks: load balancers
cut connections that stay silent through a long prefill. The stream's
dialect then comes from the path alone. The head is committed, so
whatever the upstream answers later that is not an uncompressed event
stream (an HTTP error, another type) can only end the stream with an
error event (:func:`~streamwarden.core.plan.early_refusal`, both faces' rule,
says which answers those are).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from streamwarden.config import ResolvedRoute
from streamwarden.core.headers import stream_response_headers
from streamwarden.core.plan import EARLY_PLAN, early_refusal
from streamwarden.net.upstream import Exchange, ResponseHead
from streamwarden.observation.register import Slot
from streamwarden.sidecar.driver import StreamDriver
from streamwarden.sidecar.streaming import Streaming, head_response

__all__ = ["relay_early"]


async def relay_early(
    streaming: Streaming,
    request: web.BaseRequest,
    opening: asyncio.Future[Exchange],
    route: ResolvedRoute,
    started: float,
    slot: Slot,
    extra_types: frozenset[str],
) -> web.StreamResponse:
    """Commit ``200 text/event-stream`` before the upstream answers, and relay what it does."""
    plan = EARLY_PLAN
    committed = {"Content-Type": plan.content_type or ""}
    stream, flow = streaming.open(request, route, started, plan, 200, committed)
    response = head_response(200, None, stream_response_headers(committed.items()), flow)

    def refusal(head: ResponseHead) -> str | None:
        return early_refusal(request.method, head.status, head.headers, extra_types)

    async def drive(driver: StreamDriver) -> None:
        await driver.run_early(opening, refusal)

    def settle_opening() -> None:
        if not opening.done():
            opening.cancel()
        elif not opening.cancelled() and opening.exception() is None:
            opening.result().finish()

    await streaming.run(request, response, stream, flow, slot, drive, settle_opening)
    return response
