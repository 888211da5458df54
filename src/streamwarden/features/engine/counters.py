"""The inference engine's own counters, read from its Prometheus text, with no I/O.

The sidecar next to an inference server scrapes its ``/metrics``
(``engine_metrics_url``) and compares the tokens the engine says it
generated with the tokens the sidecar saw generated in the same window.
What the engine generated and the sidecar never saw is the zombie
generation nobody can otherwise see: an engine that does not abort when
its client leaves, an abort that takes seconds, or traffic that bypasses
the sidecar.

One table names each engine's counter of generated tokens and gauge of
requests running (from each project's metrics documentation):

========= ===================================== =============================
engine    generated tokens                      requests running
========= ===================================== =============================
vllm      ``vllm:generation_tokens_total``      ``vllm:num_requests_running``
sglang    ``sglang:generation_tokens_total``    ``sglang:num_running_reqs``
tgi       ``tgi_request_generated_tokens`` (a   ``tgi_batch_current_size``
          histogram: its ``_sum``)
llamacpp  ``llamacpp:tokens_predicted_total``   ``llamacpp:requests_processing``
========= ===================================== =============================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ENGINES", "EngineNames", "EngineReading", "Reconciler", "read_engine"]


@dataclass(frozen=True, slots=True)
class EngineNames:
    """Where one engine keeps the two figures the sidecar reads."""

    #: The metric family of generated tokens (``_total`` or ``_sum`` added).
    generated: str
    generated_kind: Literal["counter", "histogram"]
    #: The gauge of requests being generated now.
    running: str


ENGINES: dict[str, EngineNames] = {
    "vllm": EngineNames("vllm:generation_tokens", "counter", "vllm:num_requests_running"),
    "sglang": EngineNames("sglang:generation_tokens", "counter", "sglang:num_running_reqs"),
    "tgi": EngineNames("tgi_request_generated_tokens", "histogram", "tgi_batch_current_size"),
    "llamacpp": EngineNames("llamacpp:tokens_predicted", "counter", "llamacpp:requests_processing"),
}


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One scrape: the engine's generated-token total and requests running."""

    engine: str
    generated: float
    running: float | None


def read_engine(text: str, engine: str = "auto") -> EngineReading | None:
    """The engine's figures from its Prometheus text, or ``None`` if they are not there.

    ``auto`` takes the first engine of the table whose counter the text has.
    Samples of one family are summed over their labels (one per model).
    Text that does not parse is ``None`` too: never an exception.
    """
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except (ValueError, TypeError, IndexError):
        return None
    candidates = ENGINES if engine == "auto" else {engine: ENGINES[engine]}
    for name, names in candidates.items():
        suffix = "_total" if names.generated_kind == "counter" else "_sum"
        generated = totals.get(names.generated + suffix)
        if generated is not None:
            return EngineReading(name, generated, totals.get(names.running))
    return None


class Reconciler:
    """Engine tokens against the sidecar's, scrape after scrape.

    ``seen`` is the sidecar's own running total of tokens generated (the
    finished streams' counts plus those in flight). Each :meth:`update`
    returns how many more tokens the engine generated, and how many more
    of them the sidecar has not seen, since the previous one. A counter
    that went down (the engine restarted) starts a new baseline.
    """

    def __init__(self) -> None:
        self._engine_base: float | None = None
        self._seen_base = 0.0
        self._engine_last = 0.0
        self._unseen_reported = 0.0

    def update(self, reading: EngineReading, seen: float) -> tuple[float, float]:
        if self._engine_base is None or reading.generated < self._engine_last:
            self._engine_base = self._engine_last = reading.generated
            self._seen_base = seen
            self._unseen_reported = 0.0
            return 0.0, 0.0
        generated = reading.generated - self._engine_last
        self._engine_last = reading.generated
        engine_since = reading.generated - self._engine_base
        seen_since = seen - self._seen_base
        unseen = max(0.0, engine_since - seen_since)
        more_unseen = max(0.0, unseen - self._unseen_reported)
        self._unseen_reported = max(self._unseen_reported, unseen)
        return generated, more_unseen

    def rebase(self, reading: EngineReading, seen: float) -> float:
        """Start a new baseline here; how many more tokens the engine generated.

        For a window whose tokens cannot all be the sidecar's to account for
        (another watch shared the engine): nothing of it counts as unseen.
        """
        restarted = self._engine_base is None or reading.generated < self._engine_last
        generated = 0.0 if restarted else reading.generated - self._engine_last
        self._engine_base = self._engine_last = reading.generated
        self._seen_base = seen
        self._unseen_reported = 0.0
        return generated
