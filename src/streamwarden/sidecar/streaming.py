"""The sidecar's streams, from their head to their record, whatever ends them.

A response that is a stream is opened through the pipeline (its stages
picked, its relay built), gets its head (the stream headers and what the
stages add), and then its body from the one
:class:`~streamwarden.sidecar.driver.StreamDriver`, which hears of a client
that leaves in the callback that read its FIN and shuts the upstream at
once. The driver runs in the handler's own task, unless the stream may
outlive its client (``on_client_gone: drain`` or ``detach``): then in a task
of its own, shielded from the cancellation aiohttp sends when the client
leaves, and read on in the background after it (:meth:`Streaming.close`
stops those at exit). A stream read on keeps what it holds until it ends:
its ``max_concurrent_streams`` slot (the handler's release no longer frees
it) and a place under ``max_client_connections`` (its upstream connection
stays open), so one client leaving and asking again cannot pile up
generations past either limit. However the stream ends, its
:class:`StreamRun` gives the upstream side back (pooled if whole, else
closed), its slot and place, and then hands the stream to the end every
stream has, in both faces.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping

from aiohttp import web

from streamwarden.config import ResolvedRoute
from streamwarden.core.headers import drop_hop_by_hop, stream_response_headers
from streamwarden.core.lifecycle import Gone, Next
from streamwarden.core.plan import StreamPlan
from streamwarden.core.usage import UsageRole
from streamwarden.net.upstream import Exchange
from streamwarden.observation.register import Slot
from streamwarden.pipeline import Pipeline, PipelineStream, StreamStart
from streamwarden.sidecar.channel import ClientChannel
from streamwarden.sidecar.deadlines import Deadlines
from streamwarden.sidecar.driver import StreamDriver
from streamwarden.sidecar.forwarding import trace_of
from streamwarden.sidecar.http import (
    CLIENT_GONE,
    ClientConnections,
    client_channel,
    travel_light,
)
from streamwarden.sidecar.streams import ActiveStream, StreamTracker

__all__ = ["StreamRun", "Streaming", "head_response"]

#: How the stream's body is driven, given its driver (a whole exchange, or
#: an upstream still opening behind early headers).
Drive = Callable[[StreamDriver], Awaitable[None]]


class Streaming:
    """The streams of one sidecar process: opened, relayed, read on, concluded."""

    __slots__ = ("_in_background", "deadlines", "pipeline", "places", "tracker")

    def __init__(self, pipeline: Pipeline[ActiveStream], tracker: StreamTracker) -> None:
        self.pipeline = pipeline
        self.tracker = tracker
        #: The relays' deadlines of every stream, on one loop timer.
        self.deadlines = Deadlines()
        #: Streams read on after their client left (on_client_gone: drain, detach).
        self._in_background: set[asyncio.Future[None]] = set()
        #: The proxy port's places (``max_client_connections``), once it listens:
        #: a stream read on holds one, as its client did.
        self.places: ClientConnections | None = None

    async def close(self) -> None:
        """Stop the streams still read on in the background (the process exits)."""
        for driving in list(self._in_background):
            driving.cancel()
        if self._in_background:
            await asyncio.wait(self._in_background, timeout=1.0)

    def open(
        self,
        request: web.BaseRequest,
        route: ResolvedRoute,
        started: float,
        plan: StreamPlan,
        status: int,
        headers: Mapping[str, str],
        usage: UsageRole = None,
    ) -> tuple[ActiveStream, PipelineStream]:
        """A new stream through the pipeline, and its entry in the tracker (not opened yet)."""
        start = StreamStart(
            "sidecar",
            route,
            plan,
            request.method,
            request.path,
            status,
            tuple(request.headers.items()),
            headers,
            started,
            asyncio.get_running_loop().time(),
            usage,
            trace_of(request),
            request.rel_url.raw_query_string,  # as sent: the middleware's is too
        )
        flow = self.pipeline.open(start)
        return ActiveStream(flow.stream_id, flow.relay, route.route), flow

    def relay(
        self,
        request: web.BaseRequest,
        exchange: Exchange,
        plan: StreamPlan,
        route: ResolvedRoute,
        started: float,
        slot: Slot,
        *,
        usage: UsageRole = None,
    ) -> Awaitable[web.StreamResponse]:
        """Relay the stream the upstream answered with (await it: its response, when done).

        Not a coroutine itself, only the stream's :meth:`run`: the frames
        the handler's task awaits in are the memory of every idle stream.
        """
        upstream = exchange.head
        stream, flow = self.open(
            request, route, started, plan, upstream.status, upstream.headers, usage
        )
        headers = stream_response_headers(
            drop_hop_by_hop(upstream.headers.items()), drop_encoding=plan.decoded
        )
        response = head_response(upstream.status, upstream.reason, headers, flow)
        del headers, upstream  # copied into the response: not kept for the stream's life
        exchange.head_relayed()
        # A lambda, not a coroutine function: no frame of its own in every stream.
        drive: Drive = lambda driver: driver.run(exchange)  # noqa: E731
        return self.run(request, response, stream, flow, slot, drive, exchange.finish)

    async def run(
        self,
        request: web.BaseRequest,
        response: web.StreamResponse,
        stream: ActiveStream,
        flow: PipelineStream,
        slot: Slot,
        drive: Drive,
        release_upstream: Callable[[], None],
    ) -> web.StreamResponse:
        """Track one stream from its head to its record, whatever ends it (returns ``response``).

        ``release_upstream`` hands the upstream side back (pooled if whole,
        else closed) once the stream is over: when this returns, or, for a
        stream drained after its client left, when the drain ends.
        """
        relay = stream.relay
        self.tracker.open(stream)
        run = StreamRun(self.pipeline, stream, flow, release_upstream, slot)
        try:
            waits, flow.before_head = flow.before_head, None
            if waits is not None:
                await waits  # a resumable stream's owner in a shared store
            await response.prepare(request)
            travel_light(request)
            channel = client_channel(request, response)
            await self._body(run, channel, drive)
            # The slot goes back before the end reaches the client: it may ask
            # again the moment it has it (an agent loop does).
            slot.release()
            if relay.next is Next.BREAK:
                channel.break_off()  # the relay says its client must fail (never quieter)
            elif not channel.closed:
                with contextlib.suppress(*CLIENT_GONE):
                    await response.write_eof()
        except asyncio.CancelledError:
            driving = run.driving
            if driving is not None and relay.next is Next.READ_ON and not driving.done():
                self._read_on(run, driving)
            else:
                run.client_left()
            raise
        except CLIENT_GONE:
            relay.client_gone(asyncio.get_running_loop().time())
            if run.driving is not None:
                run.driving.cancel()
        finally:
            if not run.in_background:
                run.conclude()
        return response

    def _body(self, run: StreamRun, channel: ClientChannel, drive: Drive) -> Awaitable[None]:
        """The stream's body as the driver relays it, once its head is sent: await it.

        Not a coroutine itself: the handler's task awaits the driver's, a
        frame less in every open stream.
        """
        run.driver = driver = _driver(channel, run.stream, run.flow, self.deadlines)
        if run.stream.relay.lifecycle.gone is Gone.CANCEL:
            # In the handler's own task: a task more per stream would be
            # memory in every open stream, and nothing outlives the client.
            return drive(driver)
        # drain and detach read the upstream on after the client left.
        # Shielded: the stream outlives the handler that aiohttp cancels
        # when the client leaves.
        run.driving = asyncio.ensure_future(drive(driver))
        return asyncio.shield(run.driving)

    def _read_on(self, run: StreamRun, driving: asyncio.Future[None]) -> None:
        """Let a drained or detached stream run on past its handler, then conclude it."""
        run.in_background = True
        # The stream is not over: it keeps its slot past the handler's
        # release, and takes the place its client's connection gave back.
        run.slot = run.slot.pass_on()
        if self.places is not None:
            run.give_back_place = self.places.hold_for_read_on()
        run.flow.counted_detached = self.pipeline.end.count_detached(run.stream.relay)
        self._in_background.add(driving)
        driving.add_done_callback(self._in_background.discard)
        driving.add_done_callback(lambda _: run.conclude())


class StreamRun:
    """One stream's part in the sidecar's handler: its driver, its task, and its end.

    The driver, and its task when the stream reads on after its client
    left (drain, detach), come as the stream goes; whatever ends it,
    :meth:`conclude` does the sidecar's own cleanup (the upstream given
    back or closed) and then the end every stream has, in both faces.
    """

    __slots__ = (
        "_pipeline",
        "_release_upstream",
        "driver",
        "driving",
        "flow",
        "give_back_place",
        "in_background",
        "slot",
        "stream",
    )

    def __init__(
        self,
        pipeline: Pipeline[ActiveStream],
        stream: ActiveStream,
        flow: PipelineStream,
        release_upstream: Callable[[], None],
        slot: Slot,
    ) -> None:
        self._pipeline = pipeline
        self.stream = stream
        self.flow = flow
        self._release_upstream = release_upstream
        #: The stream's ``max_concurrent_streams`` slot.
        self.slot = slot
        #: Gives back the place under ``max_client_connections`` that the
        #: stream holds while it is read on without its client.
        self.give_back_place: Callable[[], None] | None = None
        self.driver: StreamDriver | None = None
        self.driving: asyncio.Future[None] | None = None
        #: The stream runs on past its handler, which must not conclude it.
        self.in_background = False

    def client_left(self) -> None:
        """aiohttp cancelled the handler: the client disconnected (or the server stops)."""
        # The driver has usually shut the upstream already, in the callback
        # that read the client's FIN.
        if self.driving is not None:
            self.driving.cancel()
        if self.driver is not None:
            self.driver.client_gone()
        self.stream.relay.client_gone(asyncio.get_running_loop().time())

    def conclude(self) -> None:
        """The stream is over: the upstream side back, its slot and place, then its record."""
        if self.driver is not None:
            self.driver.finish()
        self._release_upstream()  # once: Exchange.finish acts only the first time
        self.slot.release()  # once: for a stream read on, the handler's release was a no-op
        if self.give_back_place is not None:
            self.give_back_place()
        self._pipeline.finish(self.stream, self.flow, asyncio.get_running_loop().time())


def head_response(
    status: int, reason: str | None, headers: Iterable[tuple[str, str]], flow: PipelineStream
) -> web.StreamResponse:
    """A stream's response head: its stream headers, then what its stages add."""
    response = web.StreamResponse(status=status, reason=reason)
    for name, value in flow.head(list(headers)):
        response.headers.add(name, value)
    return response


def _driver(
    channel: ClientChannel, stream: ActiveStream, flow: PipelineStream, deadlines: Deadlines
) -> StreamDriver:
    """The stream's driver, told of its client leaving and able to stop it (a resume's stop)."""
    driver = StreamDriver(
        channel,
        stream,
        flow.start.plan,
        flow.start.route.client_write_timeout,
        holds=flow.holds,
        deadlines=deadlines,
    )
    channel.on_gone(driver.client_gone)
    flow.stop_by(driver.stop)
    return driver
