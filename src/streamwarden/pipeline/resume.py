"""Resume: every event journalled under an id of ours, so a dropped client can ask again."""

from __future__ import annotations

from streamwarden.core.refusals import RefusalKind
from streamwarden.core.transform import EventTransform
from streamwarden.features.resume.model import STREAM_ID_HEADER
from streamwarden.features.resume.service import ResumeService
from streamwarden.pipeline.request import Answer, AnswerWriter, IncomingRequest, Serve
from streamwarden.pipeline.stage import FaceServices, PipelineStream, Stage, StreamStart
from streamwarden.pipeline.stamping import JournalStamps

__all__ = ["ResumeJournal"]


class ResumeJournal(Stage):
    """Journals a resumable route's streams, and answers their resumes and stops.

    A resume is served from the store and never forwarded: forwarding it
    would start a second generation.
    """

    __slots__ = ("_service",)

    name = "resume"
    summary = (
        "`on_client_gone: detach`: `id:` on every event, a journal in the store, "
        "`Last-Event-ID` served from it"
    )

    def __init__(self, services: FaceServices, service: ResumeService) -> None:
        super().__init__(services)
        self._service = service

    @classmethod
    def build(cls, services: FaceServices) -> ResumeJournal | None:
        return None if services.resume is None else cls(services, services.resume)

    def wanted(self, start: StreamStart) -> bool:
        # Ids are an SSE field: a line-framed stream has nowhere to carry one.
        return start.route.resumable and start.plan.framing == "sse"

    def transform(self, stream: PipelineStream) -> EventTransform | None:
        start = stream.start
        journal = self._service.journal(
            start.request_headers, start.query_string, stream.relay.dialect
        )
        if journal is None:  # the store keeps no more streams now: a plain stream
            return None
        stream.relay.lifecycle.detach_for(
            start.route.resume_window
        )  # a gone client: run on for a resume
        return JournalStamps(journal)

    def opened(self, stream: PipelineStream) -> None:
        relay, service, start = stream.relay, self._service, stream.start
        stamps = stream.transform_of(JournalStamps)
        if stamps is None:
            return
        journal = stamps.journal
        stream.headers.append((STREAM_ID_HEADER, journal.stream_id))
        # The head names the id: it goes out once a resume anywhere finds it.
        stream.before_head = service.storing(journal)
        service.running(
            journal, start.request_headers, start.query_string, stream.stop, relay.resumed
        )
        stream_id = journal.stream_id

        async def holds() -> float | None:
            return await service.held_for(stream_id)

        stream.holds = holds

    def closing(self, stream: PipelineStream) -> None:
        stamps = stream.transform_of(JournalStamps)
        if stamps is not None:
            relay = stream.relay
            stamps.seal(relay)
            self._service.finished(stamps.journal, str(relay.end_state), relay.dialect)

    # -- the request --------------------------------------------------------------

    async def answer(self, request: IncomingRequest) -> Answer | Serve | None:
        """A resume (``Last-Event-ID``) or an owner's ``DELETE`` of a resumable route's stream."""
        route = request.route
        if not route.resumable:
            return None
        service = self._service
        # A face without a start hook of ours (an ASGI app) starts the store here.
        await service.ensure_started()
        headers, query = request.headers, request.query_string
        asked = service.position(request.header("last-event-id"), query)
        if request.method == "DELETE" and (
            asked is not None or request.header(STREAM_ID_HEADER) is not None
        ):
            if await service.stop(headers, query, asked):
                return Answer(204)
            return Answer.refused(RefusalKind.UNKNOWN_STREAM)
        if asked is None:
            return None
        path = request.path

        async def serve(writer: AnswerWriter) -> object:
            return await service.serve(asked, headers, query, path, route, writer)

        return Serve(serve, route.client_write_timeout, service.runs_here(asked))
