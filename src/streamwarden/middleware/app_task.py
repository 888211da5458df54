"""Stopping the app: the middleware's way of closing its upstream.

For the middleware the app is the upstream, so closing the upstream (the
client left, a limit or timer ended the stream) means stopping the app,
which runs its generator's ``finally``, where the app closes its own
provider stream, at once: even while it awaits a silent provider, and even
if it never calls ``receive()``.

The app runs in the server's own task: spawning a task per request only for
the few that turn out to be streams would tax every request. So the
middleware cancels that task, the way ``asyncio.timeout`` does, and takes
its cancellation back (``Task.uncancel``) when the ``CancelledError`` comes
out of the app; whatever cancellation is left is someone else's (the
server's) and goes on up. It only ever cancels from another task or a loop
callback, never from inside the task itself, and only while the app is
running, so the ``CancelledError`` always lands inside the app.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["AppTask"]


class AppTask:
    """The app running in the request's own task, and the middleware's stop of it."""

    __slots__ = ("_base_cancelling", "_loop", "_task", "running", "stop_requested")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task[Any] | None = None
        #: The task's cancellation requests before the app started (the server's own).
        self._base_cancelling = 0
        #: The app is running: a stop can land inside it.
        self.running = False
        #: The middleware has cancelled the task (and not taken it back in send()).
        self.stop_requested = False

    @property
    def thinking(self) -> bool:
        """The app runs, and has not been stopped: its response may still come."""
        return self.running and not self.stop_requested

    def started(self) -> None:
        """The app is about to run, in the current task."""
        task = asyncio.current_task()
        self._task = task
        self._base_cancelling = task.cancelling() if task is not None else 0
        self.running = True

    def finished(self) -> None:
        """The app returned or raised: from now on nothing can land in it."""
        self.running = False

    def stop(self) -> None:
        """Cancel the app's task (where its generator waits on its provider)."""
        if not self.running or self.stop_requested or self._task is None:
            return
        if asyncio.current_task() is self._task:
            # Never cancel the running task itself: the cancellation could
            # outlive the app and land in the server. Do it once it waits.
            self._loop.call_soon(self._cancel)
        else:
            self._cancel()

    def _cancel(self) -> None:
        if self.running and not self.stop_requested and self._task is not None:
            self.stop_requested = True
            self._task.cancel()

    def take_back(self) -> bool | None:
        """The app is out: take back our stop. None if there was none, else
        whether a cancellation that is not ours is left on the task."""
        task = self._task
        if not self.stop_requested or task is None:
            return None
        return task.uncancel() > self._base_cancelling

    def take_back_in_send(self) -> bool:
        """Our stop reached the app in send() after its stream ended: make it land elsewhere.

        Cancelled in send(), a framework that iterates the app's generator
        (Starlette's ``StreamingResponse``) leaves the generator suspended at
        its ``yield``, its ``finally`` (where the app closes its provider
        stream) not run until the garbage collector finds it. That is where a
        client too slow to read always leaves the app. So send() returns
        instead (the body is closed, nothing is written), and the stop lands
        where the app next waits: in its generator. True if it was taken back.
        """
        task = asyncio.current_task()
        if not self.stop_requested or task is None:
            return False
        if task is not self._task:
            # A framework's child task (Starlette's task group), cancelled because
            # we cancelled the request's task: it is cancelled again where it next waits.
            return True
        self.stop_requested = False
        if task.uncancel() > self._base_cancelling:
            return False  # someone else's cancellation as well: it goes on
        self.stop()
        return True
