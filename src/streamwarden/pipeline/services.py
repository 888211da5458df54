"""What one face runs beside its streams, built from the settings in one place for either face.

A face (a sidecar process, a middleware instance) holds one
:class:`Services`: its metrics, its resume service (some route keeps its
streams for a resume), its telemetry (``otel_exporter``), its pipeline and
its engine watch (``engine_metrics_url``). Which of them exist follows
from the settings here, not in each face; the faces only decide *when*
they start (a sidecar at its start, a middleware at the lifespan's
startup or its first request) and close them through :meth:`Services.close`.
The faces import no feature module: the features' objects reach them
through this one, typed by what they use of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from streamwarden.config import Settings
from streamwarden.features.engine.watch import EngineWatch
from streamwarden.features.resume.service import ResumeService
from streamwarden.observation.metrics import StreamMetrics
from streamwarden.observation.register import StreamRegister
from streamwarden.pipeline import Pipeline
from streamwarden.pipeline.stage import Face, FaceServices

if TYPE_CHECKING:
    from streamwarden.observation.telemetry import Telemetry

__all__ = ["Services"]

S = TypeVar("S")

#: How long a face's close waits for its telemetry to flush: a collector
#: that is down must not hold a process's exit past its drain.
TELEMETRY_FLUSH = 2.0


class Services(Generic[S]):
    """One face's services, built from its settings; ``S`` is its register's entry."""

    __slots__ = ("engine_watch", "metrics", "pipeline", "resume", "settings", "telemetry")

    def __init__(self, face: Face, settings: Settings, register: StreamRegister[S]) -> None:
        self.settings = settings
        #: The face's own registry (each sidecar, each middleware instance).
        self.metrics = metrics = StreamMetrics(active=lambda: len(register.active))
        #: Resumes and stops, when some route keeps its streams for a resume.
        self.resume: ResumeService | None = (
            ResumeService(settings, metrics) if ResumeService.wanted(settings) else None
        )
        #: OpenTelemetry spans and GenAI metrics (otel_exporter), or None.
        self.telemetry: Telemetry | None = None
        if settings.otel_exporter != "none":
            from streamwarden.observation.telemetry import (
                Telemetry,  # the otel extra, only when asked for
            )

            # The exporters' own logging is quietened only where the process
            # is ours (the sidecar): an app's exporters are its own.
            own_process = face == "sidecar"
            self.telemetry = Telemetry(settings, metrics.otel_errors.inc, own_process=own_process)
        shared = FaceServices(
            face, settings, metrics, self.resume, metrics.inter_token.counts, self.telemetry
        )
        #: What runs on every request and every stream, and where every stream ends.
        self.pipeline: Pipeline[S] = Pipeline(shared, register)
        #: The inference engine's counters against the face's streams, or None.
        self.engine_watch = (
            EngineWatch(settings, register, self.pipeline.on_open, metrics)
            if settings.engine_metrics_url is not None
            else None
        )

    @property
    def run_beside(self) -> bool:
        """Something runs beside the streams, to start and to stop."""
        return any(s is not None for s in (self.engine_watch, self.resume, self.telemetry))

    async def start(self) -> None:
        """Start what a face starts with itself (the sidecar: all of it, at once)."""
        if self.resume is not None:
            await self.resume.start()
        if self.engine_watch is not None:
            await self.engine_watch.start()

    async def close(self) -> None:
        """Stop the engine watch and the resume store, flush the telemetry (bounded)."""
        if self.engine_watch is not None:
            await self.engine_watch.close()
        if self.resume is not None:
            await self.resume.close()
        if self.telemetry is not None:
            await self.telemetry.shutdown_within(TELEMETRY_FLUSH)
