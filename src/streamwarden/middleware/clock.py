"""The clock of a middleware stream: one timer task that runs the relay's timers.

The task calls ``relay.poll`` at ``relay.deadline`` (keep-alives,
``upstream_idle_timeout``, ``max_stream_duration``) and writes what it
returns through the stream's :class:`~streamwarden.middleware.writer.ClientWriter`,
bounded by ``client_write_timeout``; when a timer or limit ends the stream,
the app is stopped. A clock that cannot get the writer's lock within
``client_write_timeout`` is behind a write the client is not taking: the
client is too slow.

After the client left a stream that runs on (drain, detach), only the clock
runs on, writing nothing: a detached stream's window ends it unless a
resume holds it (:attr:`~streamwarden.pipeline.PipelineStream.holds`), and
the relay's limits still apply.
"""

from __future__ import annotations

import asyncio

from streamwarden.core.lifecycle import Next
from streamwarden.middleware.app_task import AppTask
from streamwarden.middleware.writer import ClientWriter
from streamwarden.pipeline import PipelineStream

__all__ = ["StreamClock"]


class StreamClock:
    """The timer task of one stream."""

    __slots__ = ("_app_task", "_flow", "_loop", "_timer", "_writer")

    def __init__(self, flow: PipelineStream, writer: ClientWriter, app_task: AppTask) -> None:
        self._flow = flow
        self._writer = writer
        self._app_task = app_task
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._timer = self._loop.create_task(self._keep_time())

    def rearm(self) -> None:
        """Make the timer look at the relay's deadline again (it may have moved sooner)."""
        timer = self._timer
        if timer is None or timer is asyncio.current_task():
            return  # none yet, or it is the caller: its loop reads the deadline next
        timer.cancel()
        self._timer = self._loop.create_task(self._keep_time())

    async def stop(self) -> None:
        """Stop the timer and wait until it has."""
        timer, self._timer = self._timer, None
        if timer is not None and not timer.done():
            timer.cancel()
            await asyncio.wait((timer,))

    async def _keep_time(self) -> None:
        """Call ``relay.poll`` at ``relay.deadline``; write what it returns."""
        writer, relay = self._writer, self._flow.relay
        lock, write_timeout = writer.lock, self._flow.start.route.client_write_timeout
        loop = self._loop
        while not writer.body_closed or relay.next is Next.READ_ON:
            deadline = relay.deadline
            if deadline is None:
                return
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if writer.body_closed:
                # Drain or detach, the client gone: only the clock runs on.
                await self._run_detached()
                if relay.done:
                    self._app_task.stop()
                    return
                continue
            try:
                # The lock is only held long by a write the client is not taking.
                async with asyncio.timeout(write_timeout or None):
                    await lock.acquire()
            except TimeoutError:
                writer.too_slow()
                return
            try:
                if writer.body_closed:
                    return
                out = relay.poll(loop.time())
                if relay.done:
                    await writer.write(out, last=True, bounded=True)
                elif out and not await writer.write(out, last=False, bounded=True):
                    return
            finally:
                lock.release()
            if relay.done:
                self._app_task.stop()
                return

    async def _run_detached(self) -> None:
        """A timer of a stream whose client left: the relay's limits, then a resume's hold."""
        relay, flow = self._flow.relay, self._flow
        loop = self._loop
        relay.poll(loop.time())  # writes nothing: there is nobody to write to
        if relay.next is Next.ASK_HOLD:
            left = None if flow.holds is None else await flow.holds()
            relay.held(loop.time(), left)
