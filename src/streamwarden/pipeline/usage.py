"""Usage injection: ask for the provider's exact count, and take back exactly what that added.

The request side (:meth:`UsageTakeBack.forwarding`, in the request step)
decides, from the request's kind and its learned habit
(:class:`~streamwarden.core.usage.UsageHabits`), whether the request goes
with ``stream_options.include_usage`` added and what its stream takes
back, or goes unchanged to learn the habit; an upstream that refuses the
option (a ``400`` naming it) gets the client's own request once more and
that kind is left alone for a while (:data:`~streamwarden.core.usage.HABIT_MEMORY`).
Injection is never tried behind early headers: a refusal then would
already be an error event, with nothing left to retry. The stream carries
the decision in :attr:`StreamStart.usage`; the stream side takes back
what was added. The face only reads the body (bounded) and the refusal.
"""

from __future__ import annotations

import asyncio
import logging

from streamwarden.core.dialects import SSE_MEDIA_TYPE, detect
from streamwarden.core.headers import credential_parts
from streamwarden.core.transform import EventTransform
from streamwarden.core.usage import (
    HabitKey,
    TakeBack,
    UsageHabits,
    refuses_stream_options,
    usage_request,
)
from streamwarden.pipeline.request import Forward, IncomingRequest, Rewrite
from streamwarden.pipeline.stage import FaceServices, PipelineStream, Stage, StreamStart
from streamwarden.pipeline.takeback import usage_transform

__all__ = ["UsageTakeBack"]

#: Request headers that sign or digest the body (AWS SigV4, RFC 9530, RFC 1864):
#: a body with one goes as it came.
_SIGNED_BODY = frozenset(
    {"x-amz-content-sha256", "content-digest", "repr-digest", "content-md5", "digest"}
)

log = logging.getLogger("streamwarden.proxy")


class UsageTakeBack(Stage):
    __slots__ = ("_habits", "_max_body_bytes")

    name = "usage"
    summary = (
        "`usage_injection`: the provider's exact count, with only what the added option "
        "added taken back out"
    )
    middleware_gap = (
        "the app builds its provider's request: the middleware only sees the app's response"
    )

    def __init__(self, services: FaceServices) -> None:
        super().__init__(services)
        self._max_body_bytes = services.settings.usage_injection_max_body_bytes
        #: What each kind of request taught (per face: one upstream).
        self._habits = UsageHabits()

    @classmethod
    def build(cls, services: FaceServices) -> UsageTakeBack | None:
        # The middleware_gap: the app's request to its provider is the app's.
        return None if services.face == "middleware" else cls(services)

    def wanted(self, start: StreamStart) -> bool:
        return start.usage is not None

    def transform(self, stream: PipelineStream) -> EventTransform | None:
        return usage_transform(stream.start.usage)

    # -- the request --------------------------------------------------------------

    async def forwarding(self, request: IncomingRequest, forward: Forward) -> None:
        """Read the body on, bounded, and rewrite it when its kind's habit allows."""
        body = request.body
        if body is None or not self._wanted(request):
            return
        start, whole = await body.read_on(forward.body_start, self._max_body_bytes)
        forward.body_start = start
        if whole:
            self._rewrite(request, forward)

    def _wanted(self, request: IncomingRequest) -> bool:
        """A streaming POST to an OpenAI-chat path on a route with ``usage_injection: auto``."""
        route = request.route
        if route.usage_injection != "auto" or request.method != "POST":
            return False
        if route.early_headers_after > 0:
            return False  # a refusal would already be an error event: nothing to retry
        length = request.content_length
        if length is not None and length > self._max_body_bytes:
            return False
        for name, value in request.headers:
            lower = name.lower()
            if lower in _SIGNED_BODY or (lower == "authorization" and value.startswith("AWS4-")):
                return False  # a body signed or digested: changed, it would fail the check
        found = detect(
            route.dialect, path=request.path, content_type=SSE_MEDIA_TYPE, headers={}, framing="sse"
        )
        return found.dialect.name == "openai-chat"

    def _rewrite(self, request: IncomingRequest, forward: Forward) -> None:
        """The body to send (none: the client's own) and the stream's part in it.

        A body that could carry the option is only changed for a kind whose
        habit is known; otherwise it goes as it came and its stream is
        watched to learn the habit. A request without credentials goes as
        it came and teaches nothing.
        """
        body = forward.body_start
        asked = usage_request(body)
        if asked is None:
            return
        credentials = credential_parts(request.headers, request.query_string)
        kind = self._habits.key(request.target, request.host, asked.model, credentials)
        if kind is None:
            return
        role = self._habits.role(kind, asyncio.get_running_loop().time())
        forward.usage = role
        if isinstance(role, TakeBack):

            def refuses(status: int, text: bytes) -> bool:
                return self._refused(kind, status, text)

            forward.rewritten = Rewrite(asked.injected, body, refuses)

    def _refused(self, kind: HabitKey, status: int, text: bytes) -> bool:
        """Whether the upstream's answer refuses the option (old vLLM); if so, remembered."""
        if not refuses_stream_options(status, text):
            return False  # the client's own 400 (one that only quotes the request included)
        self._habits.refused(kind, asyncio.get_running_loop().time())
        log.info("the upstream refused stream_options: requests of that kind go unchanged a while")
        return True
